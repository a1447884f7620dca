"""Checkpoints in one process: a round trip restores every state bit for bit, damaged or
half-written checkpoints are refused naming the file, `--resume latest` falls back to the newest
valid one, a nan stops the run without saving over the last good checkpoint, and a resumed config
that changes training is refused unless forced. Whole runs resumed (from a checkpoint before the
embedding split, and after a SIGKILL) ending bit for bit where the uninterrupted run does are
tests/test_bulk_recipe.py's (this file's kill_when_saved), the multi-process ones
test_distributed.py's."""
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import make_golden  # tests/golden, on sys.path through tests/conftest.py
import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCK_FLAGS, FOUR_BLOCKS
from test_distributed import clean_env
from test_training import all_state, assert_same_state

ROOT = Path(__file__).resolve().parent.parent


def run_argv(synthetic_dir, tmp_path, *extra, N=4):
    """A tiny run of N steps on the session's synthetic data, everything written under tmp_path."""
    return ["--preset=tiny", "--device=cpu", f"--train_files={synthetic_dir / 'synthetic_train_*.bin'}",
            f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}", "--synthetic_data=false",
            f"--num_iterations={N}", "--val_every=2", "--val_tokens=1024", "--warmup_steps=1",
            f"--log_dir={tmp_path / 'logs'}", f"--checkpoint_dir={tmp_path / 'ck'}", *extra]


def four_block_argv(synthetic_dir, tmp_path, *extra, N=4):
    """run_argv on FOUR_BLOCKS, for this file's runs: saving, finding, refusing and resuming a
    checkpoint do not depend on the depth, and every kind of block's state is in it."""
    return run_argv(synthetic_dir, tmp_path, *FOUR_BLOCK_FLAGS, *extra, N=N)


def log_text(tmp_path) -> str:
    """The body (after the source and versions) of the newest log under tmp_path/logs."""
    newest = max((tmp_path / "logs").glob("*.txt"), key=lambda p: p.stat().st_mtime_ns)
    return newest.read_text().split("=" * 100 + "\n")[-1]


def kill_when_saved(argv, tmp_path, step: int) -> Path:
    """Start the trainer on argv as a process of its own (output in tmp_path/killed.out) and SIGKILL
    it as soon as the checkpoint tmp_path/ck/tiny/step_<step> exists (or 300 s passed); require that
    the kill ended it (not a finish or a crash before). Returns that checkpoint's folder."""
    folder = tmp_path / "ck" / "tiny" / f"step_{step:06d}"
    with open(tmp_path / "killed.out", "w") as out:
        process = subprocess.Popen([sys.executable, "train_gpt_medium.py", *argv], cwd=ROOT, env=clean_env(),
                                   stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not folder.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, (tmp_path / "killed.out").read_text()[-2000:]
    return folder


def resumed_step(tmp_path) -> int:
    """The step of the checkpoint the newest log under tmp_path/logs says it resumed from."""
    return int(re.search(r"resumed from \S+step_(\d+) at step", log_text(tmp_path))[1])


@pytest.fixture(scope="module")
def pristine_run(synthetic_dir, tmp_path_factory):
    """A 4-step run that saved step_000002 and step_000004 (run once for this file)."""
    out = tmp_path_factory.mktemp("pristine")
    assert tg.main(four_block_argv(synthetic_dir, out, "--save_every=2")) == 0
    run_dir = out / "ck" / "tiny"
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_000002", "step_000004"]
    return run_dir


@pytest.fixture
def saved_run(pristine_run, tmp_path):
    """A copy of that run's checkpoints under tmp_path/ck/tiny, free to damage."""
    shutil.copytree(pristine_run, tmp_path / "ck" / "tiny")
    return tmp_path / "ck" / "tiny"


# ---- the round trip


def train_loader_of(config):
    """The training loader a run of `config` reads (document-aligned for the tiny preset), at its start."""
    return tg.train_loader(config, tg.shard_files(config.train_files, "train_files"), 0, 1, torch.device("cpu"))


def test_checkpoint_round_trip_restores_every_state_bit_for_bit_bf16(synthetic_dir, tmp_path):
    """bf16 tables and gates with Adam's bf16 moments, NorMuon's momentum and row statistics, fp32
    block matrices: model, optimizer states, the document-aligned loader's position and the next
    step all come back identical. Saved after step 1 (odd: Adam has just stepped, no gradient
    waits), then steps 2 and 3 (Adam's next step, on the gradients of both) are the same steps.
    (bf16 block matrices, whose fp32 masters Muon keeps as low 16 bits, --fp32_block_weights=false:
    tests/test_bulk_optim.py's test_checkpoint_round_trip_of_the_bulk_optimizers_is_bit_for_bit.)
    On FOUR_BLOCKS: every kind of block's state, at any depth."""
    config = tg.make_config("tiny", dtype="bfloat16", warmup_steps=0, checkpoint_dir=str(tmp_path / "ck"),
                            train_files=str(synthetic_dir / "synthetic_train_*.bin"), **FOUR_BLOCKS)
    batch = lambda loader, step: loader.next_batch(tg.slice_tokens(step, config))
    runner, loader = tg.Runner(config, torch.device("cpu")), train_loader_of(config)
    for step in range(2):
        runner.train_step(step, batch(loader, step))
    path = tg.save_checkpoint(runner, loader, 2, 123.0)
    assert config.fp32_block_weights and not any("low_bits" in s for s in runner.optimizers[1].state.values())
    assert any(p.dtype == torch.bfloat16 for p in runner.optimizers[0].state)  # Adam's moments in bf16
    resumed, resumed_loader = tg.Runner(config, torch.device("cpu")), train_loader_of(config)
    assert tg.load_checkpoint(resumed, resumed_loader, path, tg.validate_checkpoint(path)) == (2, 123.0)
    assert_same_state(all_state(resumed), all_state(runner))
    assert tg.loader_state(resumed_loader) == tg.loader_state(loader)
    for step in (2, 3):
        assert torch.equal(runner.train_step(step, batch(loader, step)),
                           resumed.train_step(step, batch(resumed_loader, step)))
    assert_same_state(all_state(resumed), all_state(runner))


# ---- damaged and half-written checkpoints


def test_truncated_checkpoint_file_is_refused_naming_the_file(saved_run, synthetic_dir, tmp_path, capsys):
    damaged = saved_run / "step_000004" / "main.pt"
    size = damaged.stat().st_size
    with open(damaged, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(tg.CheckpointError) as err:
        tg.validate_checkpoint(saved_run / "step_000004")
    assert str(damaged) in str(err.value) and str(size) in str(err.value) and "truncated" in str(err.value)
    # and from the command line: exit 2, the same message, before any training (no log written)
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, f"--resume={saved_run / 'step_000004'}")) == 2
    assert str(damaged) in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("meta_text", ["[1, 2]", '{"format": 1, "files": {"main.pt": 7}}', '{"format": 1}'])
def test_a_meta_json_that_is_not_a_checkpoints_is_refused_naming_it(saved_run, meta_text):
    meta_path = saved_run / "step_000004" / "meta.json"
    meta_path.write_text(meta_text)
    with pytest.raises(tg.CheckpointError, match="not a checkpoint's meta.json") as err:
        tg.validate_checkpoint(saved_run / "step_000004")
    assert str(meta_path) in str(err.value)


def test_an_unreadable_checkpoint_file_is_refused_naming_it(saved_run, monkeypatch):
    """As root, permissions are not enforced: the read itself is made to fail."""
    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(tg, "file_sha256", unreadable)
    with pytest.raises(tg.CheckpointError, match="Permission denied") as err:
        tg.validate_checkpoint(saved_run / "step_000004")
    assert str(saved_run / "step_000004") in str(err.value)


def test_resume_latest_skips_a_damaged_checkpoint_and_resumes_the_previous_one(saved_run, synthetic_dir, tmp_path):
    damaged = saved_run / "step_000004" / "rank_000.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped: only the hash can tell
    damaged.write_bytes(bytes(data))
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, "--resume=latest")) == 0
    body = log_text(tmp_path)
    assert f"skipping {saved_run / 'step_000004'}" in body and "SHA-256" in body
    assert f"resumed from {saved_run / 'step_000002'} at step 2/4" in body
    assert re.search(r"^step:4/4 val_loss:\d+\.\d{6} ", body, re.M)


def test_half_written_checkpoints_are_never_picked_up(saved_run, synthetic_dir, tmp_path):
    """A save interrupted before its rename leaves step_N.partial; a folder without meta.json (say,
    a copy in progress) is not complete either. Latest means the newest *valid* checkpoint."""
    shutil.copytree(saved_run / "step_000004", saved_run / "step_000006.partial")
    shutil.copytree(saved_run / "step_000004", saved_run / "step_000008")
    (saved_run / "step_000008" / "meta.json").unlink()
    config = tg.parse_args(four_block_argv(synthetic_dir, tmp_path, "--resume=latest"))
    path, meta, skipped = tg.find_checkpoint(config)
    assert path == saved_run / "step_000004" and meta["step"] == 4
    assert len(skipped) == 1 and "step_000008" in skipped[0] and "meta.json" in skipped[0]


def test_resume_latest_without_any_valid_checkpoint_is_an_error(synthetic_dir, tmp_path, capsys):
    assert tg.main(run_argv(synthetic_dir, tmp_path, "--resume=latest")) == 2
    assert "no valid checkpoint in" in capsys.readouterr().err


def test_a_fresh_run_does_not_save_into_another_runs_checkpoints(saved_run, synthetic_dir, tmp_path, capsys):
    """Else a later `--resume latest` could continue the other run's newer checkpoint."""
    assert tg.main(run_argv(synthetic_dir, tmp_path, "--save_every=2")) == 2
    assert f"{saved_run} holds checkpoints of an earlier run" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


# ---- a non-finite loss


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
        synthetic_dir, tmp_path, monkeypatch, capsys):
    """The test hook: a nan written into the head before training step index 5 (logged as step 6)
    makes that step's loss nan. Checkpoints every 2 steps: 2 and 4 are good; the check before the
    save at step 6 stops the run, so step 6 (and anything later) is never written."""
    real_step = tg.Runner.train_step

    def poisoned(self, step, batches, **kwargs):
        if step == 5:
            with torch.no_grad():
                self.model.head.weight[0, 0] = float("nan")
        return real_step(self, step, batches, **kwargs)

    monkeypatch.setattr(tg.Runner, "train_step", poisoned)
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, "--save_every=2", "--val_every=4", N=8)) == 1
    err = capsys.readouterr().err
    run_dir = tmp_path / "ck" / "tiny"
    assert "non-finite training loss" in err and "step 6/8" in err and "stopped at step 6" in err
    assert f"last good checkpoint: {run_dir / 'step_000004'}" in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_000002", "step_000004"]
    meta = tg.validate_checkpoint(run_dir / "step_000004")  # intact: every byte as written
    assert meta["step"] == 4
    model = torch.load(run_dir / "step_000004" / "main.pt", weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in model.values())
    assert "error: non-finite training loss" in log_text(tmp_path)


# ---- the config of a resumed run


def test_resume_with_a_config_that_changes_training_is_refused_listing_the_fields(
        saved_run, synthetic_dir, tmp_path, capsys):
    argv = four_block_argv(synthetic_dir, tmp_path, f"--resume={saved_run / 'step_000002'}", "--embed_lr=0.5",
                    "--run_id=other", f"--log_dir={tmp_path / 'other_logs'}", "--val_every=1", N=6)
    assert tg.main(argv) == 2
    err = capsys.readouterr().err
    assert "--embed_lr: checkpoint 0.004, now 0.5" in err and "--num_iterations: checkpoint 4, now 6" in err
    assert "--force_resume" in err
    for ignored in ("run_id", "log_dir", "val_every", "resume"):  # these don't change training
        assert f"--{ignored}:" not in err
    assert not (tmp_path / "other_logs").exists()


def test_resume_with_another_recipe_is_refused_in_one_line_naming_the_checkpoints_recipe(
        synthetic_dir, tmp_path, capsys):
    """A checkpoint of the x01 lineage (written by its frozen script) given to the live script: not
    a list of every field that differs, but which recipe the checkpoint was made with and the
    command that resumes it (the frozen script: the live one refuses --recipe=x01)."""
    frozen = make_golden.load_trainer(make_golden.X01_LINEAGE / "train_gpt_medium.py")
    with contextlib.redirect_stdout(io.StringIO()):
        assert frozen.main(run_argv(synthetic_dir, tmp_path, "--save_every=2", N=2)) == 0
    capsys.readouterr()
    argv = run_argv(synthetic_dir, tmp_path, f"--resume={tmp_path / 'ck/tiny/step_000002'}")
    assert tg.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the checkpoint was made with --preset=tiny --recipe=x01" in line and "--recipe=bulk" in line
    assert "resume it with python records/x01_lineage/train_gpt_medium.py --preset=tiny --recipe=x01" in line


def test_force_resume_accepts_the_differences_and_says_so(saved_run, synthetic_dir, tmp_path):
    config = tg.parse_args(four_block_argv(synthetic_dir, tmp_path, f"--resume={saved_run / 'step_000002'}",
                                    "--embed_lr=0.5", "--force_resume", N=6))
    (path, meta), notes = tg.prepare_checkpoints(config, torch.float32, rank=0, world_size=1)
    assert path == saved_run / "step_000002"
    assert len(notes) == 1 and "--embed_lr: checkpoint 0.004, now 0.5" in notes[0] and "num_iterations" in notes[0]


@pytest.mark.parametrize("flag,field", [("--mlp_ratio=2", "mlp_ratio"), ("--dtype=bfloat16", "dtype")])
def test_a_different_model_shape_or_storage_is_refused_even_when_forced(saved_run, synthetic_dir, tmp_path,
                                                                        flag, field):
    config = tg.parse_args(four_block_argv(synthetic_dir, tmp_path, f"--resume={saved_run / 'step_000002'}", flag,
                                    "--force_resume"))
    meta = tg.validate_checkpoint(saved_run / "step_000002")
    with pytest.raises(tg.CheckpointError, match=f"--{field}: checkpoint"):
        tg.check_resume_config(meta, config, tg.weight_dtype(config, "cpu"))


def test_the_checkpoint_records_the_resolved_dtype(saved_run):
    """`--dtype=auto` is fp32 on a CPU and bf16 on a GPU: the checkpoint keeps what it was."""
    meta = json.loads((saved_run / "step_000002" / "meta.json").read_text())
    assert meta["config"]["dtype"] == "float32" and meta["world_size"] == 1


# ---- data problems are found before training


def test_empty_validation_data_is_refused_with_the_numbers(synthetic_dir, tmp_path):
    tg.write_shard(tmp_path / "val_000000.bin", [])
    config = tg.parse_args(run_argv(synthetic_dir, tmp_path, f"--val_files={tmp_path / 'val_*.bin'}"))
    with pytest.raises(tg.ShardError, match=r"--val_files: 0 validation tokens, --val_tokens needs 1025"):
        tg.load_data(config)
