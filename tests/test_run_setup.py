"""Run setup: every input is read and checked once, the log says each flag's group, corner
configurations build their optimizers, and the command line's edges (an empty value, a closed
pipe) end cleanly."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path


import train_gpt_medium as tg
from test_checkpoint import four_block_argv
from test_metrics import body

ROOT = Path(__file__).resolve().parent.parent


def test_a_run_reads_the_byte_table_and_checks_the_world_size_once(synthetic_dir, tmp_path, monkeypatch):
    calls = {"read_token_bytes": 0, "check_world_size": 0}
    for name in calls:
        real = getattr(tg, name)

        def counted(*args, real=real, name=name, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(tg, name, counted)
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, N=3)) == 0
    assert calls == {"read_token_bytes": 1, "check_world_size": 1}


def test_the_log_gives_every_field_its_group_and_the_groups_that_make_an_experiment(tiny_seed0_run):
    """Read from the session's tiny run (tests/conftest.py)."""
    lines = {line.split(" = ", 1)[0]: line.split(" = ", 1)[1] for line in body(tiny_seed0_run["log"])
             if line.startswith(("config_groups = ", "experiment_groups = "))}
    groups = json.loads(lines["config_groups"])
    assert groups == {f.name: f.metadata["group"] for f in tg.fields(tg.Hyperparameters)}
    assert groups["muon_lr"] == "recipe" and groups["lore_rank"] == "seed ideas"
    assert groups["train_files"] == "execution" and groups["seed"] == "bookkeeping"
    assert json.loads(lines["experiment_groups"]) == ["recipe", "seed ideas", "execution"]


def test_the_console_shows_the_time_left_and_the_log_keeps_the_speedrun_format(tiny_seed0_run):
    """The session's tiny run (tests/conftest.py) printed its step lines and wrote its log: step 10 is
    the first with a time left (tg.ETA_FIRST_STEPS), on the console only."""
    step_10 = f"step:10/{tg.make_config('tiny').num_iterations} train_time"
    console = [line for line in tiny_seed0_run["stdout"].splitlines() if line.startswith(step_10)]
    assert len(console) == 1 and re.search(r" eta:\d+m\d\ds$", console[0]), console
    logged = [line for line in body(tiny_seed0_run["log"]) if line.startswith(step_10)]
    assert len(logged) == 1 and "eta" not in logged[0] and logged[0].endswith("ms")


def test_a_model_without_attention_or_value_embeddings_gets_muon_for_its_mlps_only():
    config = tg.make_config("tiny", dtype="float32", attention_free_layers=tuple(range(16)),
                            value_embed_layout=(None,) * 16)
    model = tg.build_model(config)
    adam, muon = tg.build_optimizers(model, config, rank=0, world_size=1)
    assert [g["name"] for g in muon.param_groups] == ["muon_mlp", "muon_mlp"]  # fc and proj: one group per shape
    assert {id(p) for g in muon.param_groups for p in g["params"]} == {id(p) for b in model.blocks
                                                                       for p in b.mlp.parameters()}


def test_compiled_functions_are_kept_per_set_of_options():
    def f(x):
        return x + 1
    assert tg.compiled(f) is tg.compiled(f)
    assert tg.compiled(f, fullgraph=True) is tg.compiled(f, fullgraph=True)
    assert tg.compiled(f, fullgraph=True) is not tg.compiled(f)


def test_an_empty_seed_is_refused_naming_the_flag(capsys):
    assert tg.main(["--preset=tiny", "--seed=", "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --seed") and "''" in err


def test_help_into_a_pipe_whose_reader_has_gone_ends_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -1` after its line: every write now fails with EPIPE
    try:
        trainer = subprocess.run([sys.executable, str(ROOT / "train_gpt_medium.py"), "--help"], stdout=write_end,
                                 stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
    finally:
        os.close(write_end)
    assert trainer.returncode == 0 and trainer.stderr == ""


def test_a_run_that_generates_its_synthetic_data_loads_the_trainer_once(tmp_path):
    """Run as a script (`__main__`), the trainer hands data/synthetic.py its own shard writer, so
    generating the tiny preset's data does not import the trainer a second time as a module."""
    script = f"""
import runpy, sys
sys.argv = ["train_gpt_medium.py", "--preset=tiny", "--num_iterations=3", "--val_every=0", "--warmup_steps=0",
            "--log_dir={tmp_path / 'logs'}"]
try:
    runpy.run_path({str(ROOT / 'train_gpt_medium.py')!r}, run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
print("second copy:", "train_gpt_medium" in sys.modules)
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "data" / "synthetic").is_dir()  # it did generate
    assert run.stdout.strip().splitlines()[-1] == "second copy: False"
