"""The training loop: warm-up leaves no trace, the tiny preset learns and writes its log in the
format of docs/recipe.md ("Training loop, timing and logs"). That a seed repeats a run bit for bit:
tests/test_inputs.py (test_runs_without_a_seed_differ_and_the_logged_seed_repeats_a_run_bit_for_bit)."""
import json
import re
from pathlib import Path

import pytest
import torch

import train_gpt_medium as tg
from records import runlogs
from test_bulk_model import FOUR_BLOCKS

ROOT = Path(__file__).resolve().parent.parent
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\d+\.\d{6}) train_time:(\d+)ms step_avg:(\d+\.\d{2})ms"
                      r" val_bpb:(\d+\.\d{6})$")  # val_bpb is appended after the speedrun's fields
TRAIN_LINE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:(\d+\.\d{2})ms$")


def small_run_config(synthetic_dir, **overrides):
    values = dict(train_files=str(synthetic_dir / "synthetic_train_*.bin"),
                  val_files=str(synthetic_dir / "synthetic_val_*.bin"), synthetic_data=False,
                  num_iterations=4, val_every=2, val_tokens=2048, warmup_steps=1)
    return tg.make_config("tiny", **{**values, **overrides})


def random_batches(config, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(config.batch_slices):
        tokens = torch.randint(0, config.vocab_size, (config.train_seq_len + 1,), generator=gen)
        out.append((tokens[:-1].to(torch.int32), tokens[1:].to(torch.int64)))
    return out


def all_state(runner):
    """Every tensor that defines the run's future: parameters and optimizer states, by name."""
    names = {p: n for n, p in runner.model.named_parameters()}
    state = {f"param/{n}": p.detach().clone() for n, p in runner.model.named_parameters()}
    for i, opt in enumerate(runner.optimizers):
        for p, s in opt.state.items():
            for k, v in s.items():
                state[f"opt{i}/{names[p]}/{k}"] = v.clone() if torch.is_tensor(v) else v
    return state


def runner_and_loader(config, device=torch.device("cpu")):
    """A freshly built Runner and the one-process DataLoader of config.train_files (at its start)."""
    files = tg.shard_files(config.train_files, "train_files")
    return tg.Runner(config, device), tg.DataLoader(files, config.train_seq_len, config.batch_slices, 0, 1, device)


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_warmup_then_restore_equals_a_fresh_build(dtype):
    """On FOUR_BLOCKS: the restore covers every parameter and optimizer state whatever the depth, and
    every kind of block (and so every kind of state) is there."""
    config = tg.make_config("tiny", dtype=dtype, warmup_steps=3, **FOUR_BLOCKS)
    fresh, warmed = tg.Runner(config, torch.device("cpu")), tg.Runner(config, torch.device("cpu"))
    before = all_state(warmed)
    warmed.warmup()
    assert_same_state(all_state(warmed), all_state(fresh))
    assert_same_state(all_state(warmed), before)
    for g_fresh, g_warm in zip(fresh.optimizers[1].param_groups, warmed.optimizers[1].param_groups):
        assert g_fresh["lr"] == g_warm["lr"] and g_fresh["momentum"] == g_warm["momentum"]
    # and the next steps are the same steps
    for step in range(2):
        batches = random_batches(config, seed=step)
        assert torch.equal(fresh.train_step(step, batches), warmed.train_step(step, batches))
    assert_same_state(all_state(warmed), all_state(fresh))


def test_warmup_changes_state_before_the_restore(monkeypatch):
    """Guards the test above: the warm-up really trains (so the restore is what undoes it)."""
    config = tg.make_config("tiny", dtype="float32", warmup_steps=2, **FOUR_BLOCKS)
    runner = tg.Runner(config, torch.device("cpu"))
    before = all_state(runner)
    monkeypatch.setattr(tg, "restore_state", lambda *args: None)
    runner.warmup()
    after = all_state(runner)
    assert any(not torch.equal(torch.as_tensor(before[k]), torch.as_tensor(after[k])) for k in before if k in after)


def test_too_little_training_data_is_refused_before_training(synthetic_dir):
    config = small_run_config(synthetic_dir, num_iterations=10_000)
    with pytest.raises(tg.ShardError, match=r"--train_files: 2 shard\(s\) feed at most \d+ of the run's 10000 steps"):
        tg.load_data(config)


@pytest.mark.slow
def test_tiny_preset_learns_and_logs_in_the_documented_format(tiny_seed0_run):
    """The README's first command (`--preset tiny --seed=0`, run once per session in
    tests/conftest.py): the log holds the script, the versions, then exactly the step lines of
    docs/recipe.md ("Training loop, timing and logs"), and the model clearly learned."""
    log_file = tiny_seed0_run["log"]
    meta = json.loads((ROOT / "data/synthetic/synthetic_meta.json").read_text())
    assert log_file.name.startswith("tiny_")
    text = log_file.read_text()
    source, versions, body = text.split("=" * 100 + "\n")
    files = runlogs.source_files(source.rstrip("\n"))  # the script, then triton_kernels.py under its header
    assert files["script"] == (ROOT / "train_gpt_medium.py").read_text()
    assert files["triton_kernels.py"] == (ROOT / "triton_kernels.py").read_text().rstrip("\n")
    assert f"PyTorch {torch.__version__}" in versions
    step_lines = [line for line in body.splitlines() if line.startswith("step:")]
    vals = [VAL_LINE.match(line) for line in step_lines if "val_loss" in line]
    trains = [TRAIN_LINE.match(line) for line in step_lines if "val_loss" not in line]
    assert all(vals) and all(trains)
    assert [int(m[1]) for m in vals] == [0, 38, 76, 114, 152, 190]
    assert [int(m[1]) for m in trains] == list(range(1, 191))
    assert re.fullmatch(r"peak memory allocated: \d+ MiB reserved: \d+ MiB", body.splitlines()[-2])
    assert body.splitlines()[-1] == "run ended: finished (exit 0)"
    first, final = float(vals[0][3]), float(vals[-1][3])
    # untrained: nearly uniform over the 512 padded rows. The head starts at N(0, 0.005^2), so the
    # capped logits spread by a few hundredths and the loss sits above ln 512 by about half their
    # variance (measured: 1.8e-3 at --seed=0)
    assert first == pytest.approx(torch.log(torch.tensor(512.0)).item(), abs=5e-3)
    # clearly learned: past the midpoint between "ignores context" and "perfect"
    assert final < (meta["unigram_entropy"] + meta["conditional_entropy"]) / 2, (final, meta)
    assert "final val_loss" in tiny_seed0_run["stdout"]
    # and the records tool reads the same numbers back
    parsed = runlogs.read_log(log_file)
    assert parsed.warnings == [] and parsed.result.val_loss == final
    assert parsed.result.train_time_s == int(vals[-1][4]) / 1000
