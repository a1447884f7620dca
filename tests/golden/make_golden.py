"""Record the golden outputs that prove a refactor changed nothing (run from the repo root):

    OMP_NUM_THREADS=1 .venv/bin/python tests/golden/make_golden.py

Writes tests/golden/tiny_seed0.json (the tiny preset's validation history at --seed=0, full
precision, one thread) and tests/golden/dry_run.json (the --dry_run JSON of the medium preset and
of a few switch combinations). tests/test_golden.py recomputes both and compares them bit for bit.
Regenerate only when a change is *meant* to change training, and say so in the commit.
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

# argv of the dry runs whose JSON is pinned: the record, and one switch of each idea
DRY_RUNS = {
    "medium": [],
    "tiny": ["--preset=tiny"],
    "no_extra_embeds": ["--num_extra_embeds=0"],
    "four_extra_embeds_x00_at_output": ["--num_extra_embeds=4", "--x00_at_output"],
    "lore_both_sides": ["--lore_input", "--lore_output", "--lore_init=original"],
    "ve_learned_3_tables": ["--ve_mode=learned", "--ve_tables=3"],
    "ve_grouped": ["--ve_mode=grouped", "--value_embed_layout=0,1,2,2,2,-,-,-,-,-,-,0,1,2,2,2"],
}
TINY_ARGV = ["--preset=tiny", "--seed=0"]


def tiny_history(log_dir) -> dict:
    """The tiny preset at --seed=0 on one thread, in-process: every validation (step, loss, bpb)
    at full precision and the logged step-0 training loss."""
    import torch
    import train_gpt_medium as tg

    captured = {}
    real_train = tg.train

    def recording_train(*args, **kwargs):
        captured.update(real_train(*args, **kwargs))
        return captured

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matmul reductions split differently on more threads
    tg.train = recording_train
    try:
        assert tg.main(TINY_ARGV + ["--threads=1", f"--log_dir={log_dir}"]) == 0
    finally:
        tg.train = real_train
        torch.set_num_threads(threads)
    (log,) = Path(log_dir).glob("*.txt")
    step0 = next(line for line in log.read_text().splitlines() if line.startswith("step0_train_loss:"))
    return dict(argv=TINY_ARGV, step0_train_loss_line=step0,
                val_history=[dict(step=h["step"], val_loss=h["val_loss"].hex(), val_bpb=h["val_bpb"].hex())
                             for h in captured["val_history"]])


def dry_run_json(argv) -> dict:
    import contextlib
    import io
    import train_gpt_medium as tg

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tg.main(["--dry_run"] + argv) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


if __name__ == "__main__":
    import os
    import tempfile

    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        (HERE / "tiny_seed0.json").write_text(json.dumps(tiny_history(tmp), indent=1) + "\n")
    dry = {name: dict(argv=argv, json=dry_run_json(argv)) for name, argv in DRY_RUNS.items()}
    (HERE / "dry_run.json").write_text(json.dumps(dry, indent=1) + "\n")
    print("golden files written to", HERE)
