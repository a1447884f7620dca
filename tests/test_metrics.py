"""--metrics_jsonl and --tracker (tools/metrics.py): one record per step line and per validation, each
with its step, holding the log's numbers and the steps' schedule; the log unchanged, no host sync
added, a tracker fed from the same records and imported only when asked; records/plot.py reads the
stream as it reads the log."""
import importlib.machinery
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import train_gpt_medium as tg
from records import plot, runlogs
from test_checkpoint import four_block_argv, run_argv
from tools import metrics

N = 6  # steps of the runs here: val every 2 steps; batches of 256, 512, 768 and 1024 tokens
SYNCS = (("Tensor", "item"), ("Tensor", "tolist"), ("Tensor", "cpu"))


class FakeWandb:
    """A stand-in for the wandb package (what the tracker calls of it), recording the calls."""

    def __init__(self):
        self.module = types.ModuleType("wandb")
        self.module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.module.init = self.init
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda data, step: self.logged.append((step, data)),
                                     finish=lambda: setattr(self, "finished", self.finished + 1))


class ImportWatcher:
    """A meta path finder that notes every attempt to import a tracker's package (and finds nothing)."""

    def __init__(self):
        self.seen = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("wandb", "tensorboard", "tensorboardX") or name == "torch.utils.tensorboard":
            self.seen.append(name)
        return None


def counted_run(synthetic_dir, out, *flags):
    """A tiny run of N steps on four blocks (nothing streamed depends on the depth); returns what
    happened inside train(): the calls that bring a tensor to the host, the tokens each training step
    was fed and the windows each step ran with."""
    seen = dict(syncs=0, inside=False, tokens=[], windows={})
    real_train, real_step, real_window = tg.train, tg.Runner.train_step, tg.Runner.window

    def train(*args, **kwargs):
        seen["inside"] = True
        try:
            return real_train(*args, **kwargs)
        finally:
            seen["inside"] = False

    def train_step(self, step, batches, mtp_weights=None, **kwargs):
        seen["tokens"].append(sum(inputs.numel() for inputs, _ in batches))
        return real_step(self, step, batches, mtp_weights, **kwargs)

    def window(self, step):
        w = real_window(self, step)
        seen["windows"][step] = tuple(int(v) for v in w)
        return w

    def counting(real):
        def call(*args, **kwargs):
            seen["syncs"] += seen["inside"]
            return real(*args, **kwargs)
        return call
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tg, "train", train)
        mp.setattr(tg.Runner, "train_step", train_step)
        mp.setattr(tg.Runner, "window", window)
        for owner, name in SYNCS:
            mp.setattr(getattr(torch, owner), name, counting(getattr(getattr(torch, owner), name)))
        byte_table = f"--token_bytes_file={synthetic_dir / 'synthetic_token_bytes.npy'}"
        assert tg.main(four_block_argv(synthetic_dir, out, "--seed=0", byte_table, *flags, N=N)) == 0
    seen["warmup_steps"] = 1  # run_argv's --warmup_steps: its steps come first in the lists above
    return seen


@pytest.fixture(scope="module")
def runs(synthetic_dir, tmp_path_factory):
    """The same tiny run twice: with the stream (AUTO: auto in any case, beside the log) and a tracker
    (wandb, faked), from its own working folder, and without either, watching for tracker imports."""
    fake, watcher = FakeWandb(), ImportWatcher()
    with_dir, without_dir = tmp_path_factory.mktemp("with"), tmp_path_factory.mktemp("without")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wandb", fake.module)
        mp.chdir(with_dir)  # (the byte table by its absolute path: counted_run)
        streamed = counted_run(synthetic_dir, with_dir, "--metrics_jsonl=AUTO", "--tracker=wandb")
    sys.meta_path.insert(0, watcher)
    try:
        plain = counted_run(synthetic_dir, without_dir)
    finally:
        sys.meta_path.remove(watcher)
    (log,) = (with_dir / "logs").glob("*.txt")
    (plain_log,) = (without_dir / "logs").glob("*.txt")
    records = [json.loads(line) for line in log.with_suffix(".jsonl").read_text().splitlines()]
    return dict(log=log, plain_log=plain_log, records=records, streamed=streamed, plain=plain, wandb=fake,
                imports=watcher.seen, with_dir=with_dir)


def body(log: Path) -> list[str]:
    return log.read_text().split("=" * 100 + "\n")[-1].splitlines()


def test_metrics_jsonl_auto_in_any_case_is_the_file_beside_the_log(runs):
    """--metrics_jsonl=AUTO: the stream beside the log, no file named AUTO in the working folder."""
    assert runs["log"].with_suffix(".jsonl").is_file() and not (runs["with_dir"] / "AUTO").exists()


def test_one_record_per_step_line_and_per_validation_each_with_its_step(runs):
    lines = [line for line in body(runs["log"]) if line.startswith("step:")]
    records = [r for r in runs["records"] if r["kind"] in ("step", "val")]
    assert len(records) == len(lines) == N + N // 2 + 1  # N step lines, validations at 0, 2, 4, 6
    for line, record in zip(lines, records):
        assert record["kind"] == ("val" if "val_loss:" in line else "step")
        assert line.startswith(f"step:{record['step']}/{N} ")
    assert all("step" in r for r in runs["records"])
    assert runs["records"][0]["kind"] == "run" and runs["records"][0]["log"] == str(runs["log"])
    assert [r["kind"] for r in runs["records"][-3:]] == ["final", "peak_memory", "end"]
    assert runs["records"][-1] == dict(kind="end", step=N, how="finished (exit 0)")  # the log's last line


def test_the_records_hold_the_logs_numbers(runs):
    lines = [line for line in body(runs["log"]) if line.startswith("step:")]
    for line, record in zip(lines, (r for r in runs["records"] if r["kind"] in ("step", "val"))):
        values = dict(token.split(":", 1) for token in line.split()[1:])
        assert record["train_time_ms"] == float(values["train_time"][:-2])
        assert record["step_avg_ms"] == float(values["step_avg"][:-2])
        if record["kind"] == "val":
            assert record["val_loss"] == float(values["val_loss"]) and record["val_bpb"] == float(values["val_bpb"])
    step0 = next(line for line in body(runs["log"]) if line.startswith("step0_train_loss:"))
    first = next(r for r in runs["records"] if r["kind"] == "step")
    assert first["step"] == 1 and first["train_loss"] == float(step0.split(":")[1])
    assert sum("train_loss" in r for r in runs["records"]) == 1  # the only training loss the log has


def test_the_records_hold_each_steps_schedule_as_the_run_had_it(runs, synthetic_dir, tmp_path):
    """Tokens seen: what the training steps were fed, counted at their input; windows: what the
    run's Runner.window gave for each step; lr and momentum: what the optimizers were set to."""
    config = tg.parse_args(four_block_argv(synthetic_dir, tmp_path, "--seed=0", N=N))
    fed = runs["streamed"]["tokens"][runs["streamed"]["warmup_steps"]:]
    steps = [r for r in runs["records"] if r["kind"] == "step"]
    assert [r["batch_tokens"] for r in steps] == fed == [256, 1024, 1024, 1024, 1024, 1024]
    assert [r["tokens_seen"] for r in steps] == [sum(fed[:k + 1]) for k in range(N)]
    windows = runs["streamed"]["windows"]
    for r in runs["records"]:
        if r["kind"] in ("step", "val"):
            step = r["step"] - 1 if r["kind"] == "step" else r["step"]
            assert (r["window_long_blocks"], r["window_short_blocks"]) == windows[step]
            assert r["window_long_tokens"] == windows[step][0] * config.attn_block_size
    optimizers = tg.build_optimizers(tg.build_model(config), config, 0, 1)
    for r in steps:
        tg.set_schedules(optimizers, r["step"] - 1, config)
        muon = next(opt for opt in optimizers if isinstance(opt, tg.Muon)).param_groups[0]
        assert r["lr_multiplier"] == pytest.approx(muon["lr"] / muon["initial_lr"], rel=1e-12)
        assert r["muon_lr"] == pytest.approx(muon["lr"], rel=1e-12)
        assert r["muon_momentum"] == muon["momentum"]


def masked(log: Path) -> list[str]:
    """A log's lines with what differs between two runs of one config masked: times, memory, the
    run's output folder."""
    out = []
    for line in body(log):
        line = line.replace(str(log.parent.parent), "<out>")
        if line.startswith(("config metrics_jsonl = ", "config tracker = ")):
            continue
        line = re.sub(r"\d+(\.\d+)?ms", "_ms", line)
        out.append(re.sub(r"peak memory allocated: \d+ MiB reserved: \d+ MiB", "peak memory _", line))
    return out


def test_the_log_is_the_same_with_and_without_the_stream(runs):
    with_stream, without = body(runs["log"]), body(runs["plain_log"])
    assert len(with_stream) == len(without)
    assert masked(runs["log"]) == masked(runs["plain_log"])
    assert sum(line.startswith("step:") for line in with_stream) == N + N // 2 + 1


def test_the_stream_brings_nothing_to_the_host_that_the_run_does_not(runs):
    """Calls of .item(), .tolist() and .cpu() inside train() (the loop's host syncs): the same count
    with the stream and tracker as without them."""
    assert runs["streamed"]["syncs"] == runs["plain"]["syncs"] > 0


def test_the_tracker_gets_the_numbers_of_the_same_records(runs):
    fake = runs["wandb"]
    assert len(fake.inits) == 1 and fake.inits[0]["name"] == runs["log"].stem and fake.finished == 1
    fed = [r for r in runs["records"] if r["kind"] not in ("run", "end")]  # the two without a number
    assert [step for step, _ in fake.logged] == [r["step"] for r in fed]
    assert [data for _, data in fake.logged] == [metrics.numbers(r) for r in fed]
    val = next(data for step, data in fake.logged if "val/val_loss" in data and step == N)
    assert val["val/val_loss"] == runs["records"][-4]["val_loss"]


def test_trackers_are_imported_only_when_asked(runs):
    assert runs["imports"] == []


def test_plot_reads_the_stream_as_it_reads_the_log(runs, tmp_path):
    from_log, from_stream = runlogs.parse_log(runs["log"]), runlogs.parse_log(runs["log"].with_suffix(".jsonl"))
    assert from_stream.finished and from_stream.history == from_log.history and len(from_log.history) == 4
    assert from_stream.val_loss == from_log.val_loss and from_stream.train_time_s == from_log.train_time_s
    assert runlogs.experiment_key(from_stream) == runlogs.experiment_key(from_log)
    assert from_stream.step0_train_loss == from_log.step0_train_loss
    assert from_stream.package_time_s == from_log.package_time_s and not from_stream.warnings
    out = tmp_path / "curves.png"
    assert plot.main(["curves", str(runs["log"].with_suffix(".jsonl")), "-o", str(out)]) == 0
    assert out.stat().st_size > 5000


def test_an_existing_metrics_file_is_refused_before_training(synthetic_dir, tmp_path, capsys):
    taken = tmp_path / "m.jsonl"
    taken.write_text("another run's records\n")
    assert tg.main(run_argv(synthetic_dir, tmp_path, f"--metrics_jsonl={taken}", N=N)) == 2
    assert f"error: --metrics_jsonl {taken}: exists, and is kept" in capsys.readouterr().err
    assert taken.read_text() == "another run's records\n" and not (tmp_path / "logs").exists()


def test_a_tracker_that_is_not_installed_is_refused_before_training(synthetic_dir, tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert tg.main(run_argv(synthetic_dir, tmp_path, "--tracker=wandb", N=N)) == 2
    err = capsys.readouterr().err
    assert "--tracker=wandb: the wandb package is not installed (pip install wandb)" in err
    assert not (tmp_path / "logs").exists()


def test_a_real_tensorboard_writes_its_event_file(synthetic_dir, tmp_path):
    pytest.importorskip("tensorboard")
    assert tg.main(run_argv(synthetic_dir, tmp_path, "--tracker=tensorboard", N=2)) == 0
    assert list((tmp_path / "logs" / "tensorboard").rglob("events.out.tfevents.*"))


def test_a_real_wandb_runs_offline(synthetic_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert tg.main(run_argv(synthetic_dir, tmp_path, "--tracker=wandb", N=2)) == 0
    assert list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
