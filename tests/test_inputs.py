"""Inputs and outputs of a run: a bad flag or a bad file is one line naming it, exit code 2, found
before training and before anything is written; a checkpoint or log write that fails (disk full)
stops the run with exit code 3, removes the half-written checkpoint and keeps the earlier ones;
--help lists every flag; a nan stops the run at the next check; synthetic data is generated only
into its own folder; runs without --seed are independent and the logged seed repeats them.
docs/inputs.md describes all of it."""
import contextlib
import errno
import io
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCK_FLAGS
from test_checkpoint import log_text, run_argv
from test_distributed import RANK_START_METHOD, clean_env, free_port

ROOT = Path(__file__).resolve().parent.parent


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def argv_with(synthetic_dir, tmp_path, *flags, N=4) -> list[str]:
    """test_checkpoint's tiny run (logs and checkpoints under tmp_path) on 4 blocks with `flags`
    replacing the base flags of the same name (so no 'given twice' warning joins the error). The
    refusals, failed writes, stops and seeds here act the same at any depth (test_bulk_model.FOUR_BLOCKS
    keeps every layer pattern), and a 4-block step costs half a 16-block one."""
    names = {flag.split("=", 1)[0] for flag in flags}
    base = run_argv(synthetic_dir, tmp_path, *FOUR_BLOCK_FLAGS, N=N)
    return [a for a in base if a.split("=", 1)[0] not in names] + list(flags)


def refused(argv, capsys) -> str:
    """main exits 2 with exactly one line on stderr and no traceback; returns the line."""
    assert tg.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def nothing_written(tmp_path) -> bool:
    return not (tmp_path / "logs").exists() and not (tmp_path / "ck").exists()


def log_lines(tmp_path, prefix: str) -> list[str]:
    return [line for line in log_text(tmp_path).splitlines() if line.startswith(prefix)]


# ---- bad flags: exit 2 naming the flag, before anything is written


BAD_FLAGS = [
    ("--muon_lr=-1",), ("--embed_lr=-1",), ("--cooldown_frac=2",), ("--val_every=-1",), ("--warmup_steps=-1",),
    ("--adam_beta1=1.5",), ("--mlp_ratio=-1",), ("--num_iterations=0",), ("--seed=-3",), ("--seed=18446744073709551616",),
    ("--device=tpu",),
    ("--lore_init=bad",), ("--head_lr=nan",), ("--value_embed_layout=0,x",),
    ("--attention=flex", "--device=cpu"),  # eager flex on a CPU computes the wrong mask: refused
]


def test_the_base_run_of_the_bad_flag_table_writes_a_log_and_checkpoints(synthetic_dir, tmp_path):
    """The control: without the bad flag the same command trains and writes both folders, so
    'nothing written' below is the refusal's doing."""
    assert tg.main(argv_with(synthetic_dir, tmp_path, "--save_every=2")) == 0
    assert not nothing_written(tmp_path)
    assert (tmp_path / "ck" / "tiny" / "step_000004").is_dir() and list((tmp_path / "logs").glob("*.txt"))


@pytest.mark.parametrize("flags", BAD_FLAGS, ids=lambda flags: flags[0])
def test_a_bad_flag_exits_2_naming_it_and_writes_nothing(flags, synthetic_dir, tmp_path, capsys):
    line = refused(argv_with(synthetic_dir, tmp_path, "--save_every=2", *flags), capsys)
    assert line.startswith("error: ") and flags[0].split("=")[0] + ":" in line
    assert nothing_written(tmp_path)


# ---- bad files: one line naming the file and the fix, exit 2, before anything is written


def shard_folder(synthetic_dir, folder: Path) -> Path:
    """A folder holding (links to) the session's synthetic shards."""
    folder.mkdir()
    for shard in synthetic_dir.glob("synthetic_*.bin"):
        (folder / shard.name).symlink_to(shard)
    return folder


def test_a_folder_matching_the_shard_pattern_is_refused_naming_it(synthetic_dir, tmp_path, capsys):
    shards = shard_folder(synthetic_dir, tmp_path / "shards")
    (shards / "synthetic_train_000003.bin").mkdir()  # say, an unpacked archive
    line = refused(argv_with(synthetic_dir, tmp_path, f"--train_files={shards / 'synthetic_train_*.bin'}"), capsys)
    assert f"--train_files: {shards / 'synthetic_train_000003.bin'} is a folder, not a shard" in line
    assert nothing_written(tmp_path)


def test_an_unreadable_shard_is_refused_naming_it(synthetic_dir, tmp_path, monkeypatch, capsys):
    """The permission is mocked (root reads a chmod-000 file anyway): opening that one file fails
    the way it does for a user without read permission."""
    shards = shard_folder(synthetic_dir, tmp_path / "shards")
    locked, real_open = shards / "synthetic_val_000000.bin", open

    def open_without_permission(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file) == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", open_without_permission)
    line = refused(argv_with(synthetic_dir, tmp_path, f"--val_files={shards / 'synthetic_val_*.bin'}"), capsys)
    assert f"--val_files: {locked} cannot be read (Permission denied)" in line
    assert nothing_written(tmp_path)


def write_text(path: Path) -> None:
    path.write_text("token,bytes\n0,1\n")


TABLES = {  # name: (how to make the bad --token_bytes_file, what the message says)
    "text": (write_text, "is not a .npy array file"),
    "empty": (lambda path: path.write_bytes(b""), "is not a .npy array file"),
    "floats": (lambda path: np.save(path, np.ones(500)), "holds float64 values"),
    "short": (lambda path: np.save(path, np.ones(499, dtype=np.uint8)), "has shape (499,)"),
    "two_dims": (lambda path: np.save(path, np.ones((500, 1), dtype=np.uint8)), "has shape (500, 1)"),
    "negative": (lambda path: np.save(path, np.full(500, -1, dtype=np.int16)), "negative byte counts"),
    "archive": (lambda path: np.savez(path, lengths=np.ones(500, dtype=np.uint8)), ".npz archive"),
    "folder": (lambda path: path.mkdir(), "is a folder"),
    "missing": (lambda path: None, "does not exist"),
}


@pytest.mark.parametrize("kind", sorted(TABLES))
def test_a_token_bytes_file_that_is_not_a_table_is_refused(kind, synthetic_dir, tmp_path, capsys):
    make, says = TABLES[kind]
    path = tmp_path / "bytes.npy"
    make(path)
    if kind == "archive":
        path = tmp_path / "bytes.npy.npz"  # np.savez appends .npz
    line = refused(argv_with(synthetic_dir, tmp_path, f"--token_bytes_file={path}"), capsys)
    assert line.startswith(f"error: --token_bytes_file: {path} ") and says in line
    assert nothing_written(tmp_path)


def test_a_good_token_bytes_table_reports_val_bpb(synthetic_dir, tmp_path):
    """The control of the table above: a uint8 table of one count per token id is accepted."""
    table = tmp_path / "bytes.npy"
    np.save(table, np.ones(500, dtype=np.uint8))
    assert tg.main(argv_with(synthetic_dir, tmp_path, f"--token_bytes_file={table}")) == 0
    assert re.search(r"^step:4/4 val_loss:\S+ .* val_bpb:\d+\.\d{6}$", log_text(tmp_path), re.M)


def test_a_missing_default_token_bytes_table_is_a_note_not_an_error(synthetic_dir, tmp_path, monkeypatch):
    """The preset's own table may be absent (a checkout without data): val_bpb is left out, said in
    the log. Here the tiny preset's relative default path does not exist in the working folder."""
    monkeypatch.chdir(tmp_path)
    assert not Path(tg.make_config("tiny").token_bytes_file).exists()
    assert tg.main(argv_with(synthetic_dir, tmp_path)) == 0
    note = "val_bpb: not reported (the tiny preset's table data/synthetic/synthetic_token_bytes.npy is missing)"
    assert note in log_text(tmp_path)
    assert "val_bpb:" not in "".join(log_lines(tmp_path, "step:4/4 val_loss:"))


def unwritable_place() -> Path:
    """A folder no process may create files in (root included), or skip."""
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            pytest.skip("/sys is writable here")
    except OSError:
        return Path("/sys/speedrun_outputs")


@pytest.mark.parametrize("flag", ["log_dir", "checkpoint_dir"])
@pytest.mark.parametrize("where", ["a_file", "below_a_file", "unwritable"])
def test_an_output_folder_that_cannot_be_written_is_refused_before_training(flag, where, synthetic_dir, tmp_path,
                                                                            capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be\n")
    folder = dict(a_file=blocker, below_a_file=blocker / "sub", unwritable=None)[where] or unwritable_place()
    line = refused(argv_with(synthetic_dir, tmp_path, "--save_every=2", f"--{flag}={folder}"), capsys)
    assert line.startswith(f"error: --{flag}: ")
    expected = f"{blocker} is a file, not a folder" if where != "unwritable" else "cannot create files in /sys ("
    assert expected in line and "choose a folder this process can write" in line
    assert nothing_written(tmp_path)


def test_the_checkpoint_folder_is_not_checked_when_nothing_is_saved(synthetic_dir, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    assert tg.main(argv_with(synthetic_dir, tmp_path, f"--checkpoint_dir={blocker}")) == 0


def test_a_bad_file_from_the_command_line_prints_one_line_and_no_traceback(synthetic_dir, tmp_path):
    """The same through a real process: what the user sees on the terminal."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    argv = argv_with(synthetic_dir, tmp_path, f"--log_dir={blocker}")
    result = subprocess.run([sys.executable, "train_gpt_medium.py", *argv], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=clean_env())
    assert result.returncode == 2
    assert result.stderr == f"error: --log_dir: {blocker} is a file, not a folder; choose a folder this " \
                            "process can write\n"


# ---- writes that fail mid-run: exit 3, the message names the path and the OS error


def test_a_checkpoint_write_that_fails_midway_exits_3_and_keeps_the_last_good_checkpoint(
        synthetic_dir, tmp_path, monkeypatch, capsys):
    """The disk fills while step 4 is saved: step 2 wrote rank_000.pt, main.pt and meta.json; step 4's
    second file fails. The run stops (exit 3), step_000004.partial is gone, step_000002 still
    validates, and --resume latest continues from it to the end."""
    real_write, written = tg._write_durably, []

    def disk_full_at_the_fifth_file(path, obj):
        written.append(path)
        if len(written) == 5:
            raise disk_full()
        return real_write(path, obj)

    monkeypatch.setattr(tg, "_write_durably", disk_full_at_the_fifth_file)
    assert tg.main(argv_with(synthetic_dir, tmp_path, "--save_every=2")) == 3
    err = capsys.readouterr().err
    run_dir = tmp_path / "ck" / "tiny"
    failed = run_dir / "step_000004.partial" / "main.pt"
    assert written[-1] == failed
    assert f"cannot write {failed} (No space left on device)" in err and len(err.strip().splitlines()) == 1
    assert "the disk is full; free space there or give another --checkpoint_dir" in err  # what to do
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_000002"]
    assert tg.validate_checkpoint(run_dir / "step_000002")["step"] == 2
    assert "error: checkpoint step_000004.partial not saved: cannot write" in log_text(tmp_path)
    assert log_text(tmp_path).splitlines()[-1] == "run ended: stopped by an error at step 4/4 (exit 3)"

    monkeypatch.setattr(tg, "_write_durably", real_write)
    assert tg.main(argv_with(synthetic_dir, tmp_path, "--save_every=2", "--resume=latest")) == 0
    assert f"resumed from {run_dir / 'step_000002'} at step 2/4" in log_text(tmp_path)
    assert tg.validate_checkpoint(run_dir / "step_000004")["step"] == 4


TORCH_FULL_DISK = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3091904 vs 3091792")


def free_space(free: int):
    """shutil.disk_usage, for every folder: `free` bytes left."""
    return lambda folder: types.SimpleNamespace(total=2**40, used=2**40 - free, free=free)


def test_torch_saves_own_error_on_a_full_disk_says_the_disk_is_full_in_one_line_exit_3(
        synthetic_dir, tmp_path, monkeypatch, capsys):
    """On a full disk torch.save does not raise an OSError: its zip writer raises a RuntimeError
    (`unexpected pos A vs B`) that names no cause. With less room in the folder than the save needs,
    the line says the disk is full and what to do, not torch's internals; exit 3, and the
    half-written step_N.partial is removed."""
    real_save, calls = torch.save, []

    def save_on_a_full_disk(obj, f, *args, **kwargs):
        calls.append(getattr(f, "name", f))
        if len(calls) == 4:  # step 4's main.pt (each save: rank_000.pt, then main.pt)
            raise TORCH_FULL_DISK
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(tg.torch, "save", save_on_a_full_disk)
    monkeypatch.setattr(tg.shutil, "disk_usage", free_space(0))
    assert tg.main(argv_with(synthetic_dir, tmp_path, "--save_every=2")) == 3
    err = capsys.readouterr().err.strip()
    run_dir = tmp_path / "ck" / "tiny"
    assert len(err.splitlines()) == 1 and "not saved" in err and "enforce fail" not in err
    assert f"cannot write {run_dir / 'step_000004.partial' / 'main.pt'} (No space left on device: 0.0 MiB free" in err
    assert "the disk is full; free space there or give another --checkpoint_dir" in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_000002"]  # no step_000004.partial left


def test_torch_saves_error_names_the_room_a_save_needed(tmp_path, monkeypatch):
    """The room a save needs: the bytes of the tensors it holds (here 4 MiB of float32 and 1 MiB of
    int64); with less free, torch's error becomes the OS's full-disk error, saying both sizes."""
    def failing_save(obj, f, *args, **kwargs):
        raise TORCH_FULL_DISK

    monkeypatch.setattr(tg.torch, "save", failing_save)
    monkeypatch.setattr(tg.shutil, "disk_usage", free_space(3 * 2**20 + 2**19))
    state = dict(model={"w": torch.zeros(1024, 1024)}, rows=[torch.zeros(2**17, dtype=torch.int64)], step=4)
    with pytest.raises(OSError) as raised:
        tg._write_durably(tmp_path / "main.pt", state)
    assert raised.value.errno == errno.ENOSPC and raised.value.__cause__ is TORCH_FULL_DISK
    assert raised.value.strerror == "No space left on device: 3.5 MiB free, the file needs about 5.0 MiB"


def test_torch_saves_error_with_room_to_spare_is_torchs_own(tmp_path, monkeypatch):
    """A failure that is not a full disk (room for the whole save) is not called one."""
    def failing_save(obj, f, *args, **kwargs):
        raise TORCH_FULL_DISK

    monkeypatch.setattr(tg.torch, "save", failing_save)
    monkeypatch.setattr(tg.shutil, "disk_usage", free_space(5 * 2**20))
    with pytest.raises(RuntimeError) as raised:
        tg._write_durably(tmp_path / "main.pt", dict(model={"w": torch.zeros(1024, 1024)}))
    assert raised.value is TORCH_FULL_DISK


def test_a_log_that_cannot_be_written_midway_exits_3_keeping_what_it_holds(synthetic_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """The disk fills after training step 2: the next log line fails; the lines before it stay."""
    real_open, real_step, full = open, tg.Runner.train_step, []

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        if full and isinstance(file, (str, os.PathLike)) and Path(file).parent == tmp_path / "logs":
            raise disk_full()
        return real_open(file, mode, *args, **kwargs)

    def step_then_fill_the_disk(self, step, batches, **kwargs):
        loss = real_step(self, step, batches, **kwargs)
        if step == 2:  # after the val line of step 2; the line of step:3 is the first that fails
            full.append(True)
        return loss

    monkeypatch.setattr("builtins.open", open_on_a_full_disk)
    monkeypatch.setattr(tg.Runner, "train_step", step_then_fill_the_disk)
    assert tg.main(argv_with(synthetic_dir, tmp_path)) == 3
    err = capsys.readouterr().err
    full.clear()
    (log,) = (tmp_path / "logs").glob("*.txt")
    assert f"cannot write the log {log} (No space left on device): the disk is full; free space there or give " \
           "another --log_dir" in err
    body = log.read_text().split("=" * 100 + "\n")[-1]
    assert body.rstrip().splitlines()[-1].startswith("step:2/4 val_loss:")  # all it held is still there


def _two_process_worker(rank: int, runs: list, out: Path) -> None:
    """Rank `rank` of 2-process runs (name, port, argv), one after another in the same processes; in
    the run named disk_full rank 0 finds the disk full when it writes main.pt. Writes each run's exit
    code and stderr to out/<name>_rank<r>.txt."""
    torch.set_num_threads(1)
    real_write = tg._write_durably
    for name, port, argv in runs:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))

        def rank0_disk_full(path, obj, full=(name == "disk_full" and rank == 0)):
            if full and path.name == "main.pt":
                raise disk_full()
            return real_write(path, obj)

        tg._write_durably = rank0_disk_full
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = tg.main(argv)
        (out / f"{name}_rank{rank}.txt").write_text(f"{code}\n{err.getvalue()}")
    os._exit(0)  # see test_distributed._rank_worker: no interpreter shutdown with gloo threads about


@pytest.fixture(scope="module")
def two_process_runs(synthetic_dir, tmp_path_factory) -> dict:
    """Both 2-process failures in one pair of forked processes (a process's start is most of a run's
    cost; each run has its own process group and port): rank 0 refusing the log
    folder, then rank 0 failing to write a checkpoint. {name: (its folder, [(exit code, stderr) by
    rank])}; fails if a rank is still running after 300 s (a hang)."""
    out = tmp_path_factory.mktemp("two_processes")
    folders = {name: tmp_path_factory.mktemp(name) for name in ("log_dir", "disk_full")}
    blocker = folders["log_dir"] / "blocker"
    blocker.write_text("")
    ports = [free_port()]
    while len(ports) < 2:
        ports += [port for port in [free_port()] if port not in ports]
    runs = [("log_dir", ports[0], argv_with(synthetic_dir, folders["log_dir"], f"--log_dir={blocker}", "--seed=0",
                                            N=3)),
            ("disk_full", ports[1], argv_with(synthetic_dir, folders["disk_full"], "--save_every=2", "--seed=0", N=3))]
    context = torch.multiprocessing.start_processes(_two_process_worker, args=(runs, out), nprocs=2, join=False,
                                                    start_method=RANK_START_METHOD)
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("a rank was still running 300 s after the start: the failure did not reach it")
    return {name: (folders[name], [tuple((out / f"{name}_rank{rank}.txt").read_text().split("\n", 1))
                                   for rank in range(2)]) for name in folders}


def test_a_checkpoint_write_failing_on_rank_0_stops_every_rank(two_process_runs):
    """Both ranks learn of rank 0's failure at the same point (a vote after the files are written),
    so rank 1 exits 3 too instead of waiting in the next collective forever."""
    tmp_path, ((code0, err0), (code1, err1)) = two_process_runs["disk_full"]
    assert (code0, code1) == ("3", "3")
    assert "error (rank 0): checkpoint step_000002.partial not saved: cannot write" in err0
    assert "No space left on device" in err0
    assert "error (rank 1): checkpoint step_000002.partial not saved: another rank could not write" in err1
    assert list((tmp_path / "ck" / "tiny").iterdir()) == []


def test_an_output_folder_refused_on_rank_0_stops_every_rank_before_training(two_process_runs):
    """Rank 0 checks the log folder and hands its verdict to every rank: both exit 2, rank 0 says why."""
    tmp_path, ((code0, err0), (code1, err1)) = two_process_runs["log_dir"]
    blocker = tmp_path / "blocker"
    assert (code0, code1) == ("2", "2")
    assert err0 == f"error: --log_dir: {blocker} is a file, not a folder; choose a folder this process can write\n"
    assert err1 == ""  # input errors are printed once, by rank 0


# ---- --help


def help_blocks(text: str) -> dict[str, str]:
    """{flag name: its help entry, whitespace collapsed} from argparse's output."""
    parts = re.split(r"^  --(\w+)", text, flags=re.M)
    return {name: " ".join(body.split()) for name, body in zip(parts[1::2], parts[2::2])}


def as_typed(value) -> str:
    """A default as one types it: auto for None, true/false, comma lists, target<source pairs."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join("<".join(map(str, v)) if isinstance(v, tuple) else "-" if v is None else str(v)
                        for v in value)
    return "''" if value == "" else str(value)


def placeholder(f) -> str:
    """What argparse shows after the flag: the choices, true|false, LIST, or the type."""
    if f.metadata.get("choices"):
        return "|".join(f.metadata["choices"])
    kind = str(f.type)
    if "bool" in kind:
        return "[true|false]"  # the value is optional: a bare flag means true
    if kind.startswith(("tuple", "Optional[tuple")):
        return "LIST"
    return {"int": "INT", "Optional[int]": "INT", "float": "FLOAT", "Optional[float]": "FLOAT", "str": "STR"}[kind]


def test_help_lists_every_field_with_its_type_and_default(capsys):
    """Derived from the dataclass, so a new field cannot be left out."""
    assert tg.main(["--help"]) == 0
    blocks = help_blocks(capsys.readouterr().out)
    assert list(blocks) == [f.name for f in tg.fields(tg.Hyperparameters)]  # in the dataclass's order
    for f in tg.fields(tg.Hyperparameters):
        assert blocks[f.name].startswith(placeholder(f) + " "), f.name
        assert re.search(rf"\[default {re.escape(as_typed(f.default))}[;\]]", blocks[f.name]), f.name


def test_help_shows_the_allowed_range():
    text = tg.help_text()
    assert "[default 0.8; >= 0 and < 1]" in " ".join(help_blocks(text)["adam_beta1"].split())


# ---- a non-finite loss stops the run at the next check


def test_a_nonfinite_loss_stops_the_run_at_the_first_check_after_it(synthetic_dir, tmp_path, monkeypatch, capsys):
    """A nan written into the head before the step logged as step:8 makes its loss nan; with a
    check every 3 steps the run stops right after training step 9 (the first multiple of 3 at or
    after 8), long before the end (step 30), and step 9 is never logged."""
    bad, every, N = 8, 3, 30
    real_step = tg.Runner.train_step

    def poisoned(self, step, batches, **kwargs):
        if step + 1 == bad:
            with torch.no_grad():
                self.model.head.weight[0, 0] = float("nan")
        return real_step(self, step, batches, **kwargs)

    monkeypatch.setattr(tg.Runner, "train_step", poisoned)
    argv = argv_with(synthetic_dir, tmp_path, f"--nonfinite_check_every={every}", "--val_every=0",
                     "--warmup_steps=0", N=N)
    assert tg.main(argv) == 1
    stop = -(-bad // every) * every
    assert stop == 9
    err = capsys.readouterr().err
    assert f"non-finite training loss (nan or inf) in step {bad}/{N}" in err and f"stopped at step {stop} " in err
    logged = [int(line.split("/")[0].removeprefix("step:")) for line in log_lines(tmp_path, "step:")]
    assert max(logged) == stop - 1
    assert log_text(tmp_path).splitlines()[-1] == f"run ended: stopped by a non-finite loss at step {stop - 1}/{N} (exit 1)"


# ---- synthetic data only in its own folder


def test_a_mistyped_train_files_with_the_tiny_preset_is_an_error_and_generates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = refused(["--preset=tiny", "--device=cpu", "--train_files=data/synthtic/synthetic_train_*.bin",
                    "--num_iterations=4", f"--log_dir={tmp_path / 'logs'}"], capsys)
    assert line.startswith("error: --train_files: no files match 'data/synthtic/synthetic_train_*.bin'")
    assert "python data/synthetic.py --out" in line
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tiny_preset_data(tmp_path_factory):
    """The tiny preset's data generated once from an empty working folder, for the two tests below
    that read it: (that folder, the names of the files moved into data/synthetic/ in their order,
    what it printed). Only moves into that folder are recorded: the shard writer's own atomic
    writes happen inside its staging folder."""
    folder, moved, printed, real_replace = tmp_path_factory.mktemp("tiny_preset_data"), [], io.StringIO(), os.replace

    def replace(src, dst):
        if Path(dst).parent.name == "synthetic":
            moved.append(Path(dst).name)
        real_replace(src, dst)

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.chdir(folder)
        patch.setattr(tg.os, "replace", replace)
        tg.ensure_synthetic_data(tg.make_config("tiny"))
    return folder, moved, printed.getvalue()


def test_the_tiny_preset_generates_its_data_into_its_own_folder(tiny_preset_data):
    """The control: with the preset's own paths the data appears under data/synthetic/."""
    folder, _, _ = tiny_preset_data
    assert sorted(p.name for p in (folder / "data" / "synthetic").iterdir()) == [
        "synthetic_meta.json", "synthetic_token_bytes.npy", "synthetic_tokens.bin", "synthetic_train_000001.bin",
        "synthetic_train_000002.bin", "synthetic_val_000000.bin"]


def test_synthetic_data_appears_whole_with_the_token_byte_table_last(tiny_preset_data):
    """Generated beside data/synthetic/ and moved in file by file, the table a run checks for last:
    a second run starting meanwhile never reads a half-written shard. Nothing is left beside it."""
    folder, moved, printed = tiny_preset_data
    assert len(moved) == 6 and moved[-1] == "synthetic_token_bytes.npy"
    assert [p.name for p in (folder / "data").iterdir()] == ["synthetic"]
    assert printed.startswith("synthetic data in data/synthetic: conditional entropy ")


def test_synthetic_data_is_never_generated_into_the_fineweb_folder(tmp_path, monkeypatch):
    """(A small vocabulary: should this regress, the generator's V x V chain stays small.)"""
    monkeypatch.chdir(tmp_path)
    tg.ensure_synthetic_data(tg.make_config("medium", synthetic_data=True, vocab_size=500, eot_token=499))
    assert list(tmp_path.iterdir()) == []


# ---- the dry run reports the device the run would use


def dry_run_output(argv, capsys) -> str:
    assert tg.main(["--dry_run", *argv]) == 0
    return capsys.readouterr().out


def test_dry_run_on_the_cpu_reports_float32_bytes_and_the_cuda_totals_labelled(capsys):
    """The tiny model (tables padded to 512 rows of 64) has 262,296 Adam parameters: 262,208 in
    tables and gates (head 32,768 + two input tables 65,536 + value embeddings 163,840 + smear and
    skip gates 64) and 88 fp32 ones (56 scalars + 32 x0 lambdas); and 787,264 Muon ones: 786,432 in
    block matrices (stored fp32: --fp32_block_weights) and 832 in the heads' gates, with NorMuon's
    row statistics (one per row: 16 x 256 attention, 32 x 256 MLP, 26 x 2 gates = 12,340). fp32 on
    the CPU: 4 bytes each, Adam 2 x 4 bytes, Muon 4 (momentum) + 4 per row. bf16 on CUDA: tables
    and gates 2 bytes, Adam moments in the parameter's dtype; the block matrices stay fp32 (no low
    bits to keep), the gates' momentum and statistics in bf16."""
    out = dry_run_output(["--preset=tiny", "--device=cpu"], capsys)
    tables, fp32_adam, blocks, gates, rows, gate_rows = 262_208, 88, 786_432, 832, 12_288, 52
    assert tables + fp32_adam + blocks + gates == 1_049_560
    mib = lambda nbytes: f"{nbytes / 2**20:.1f} MiB"
    cpu_params = 4 * (tables + fp32_adam + blocks + gates)
    cpu_state = 8 * (tables + fp32_adam) + 4 * (blocks + gates) + 4 * (rows + gate_rows)
    cuda_params = 2 * tables + 4 * fp32_adam + 4 * blocks + 2 * gates
    cuda_state = 4 * tables + 8 * fp32_adam + 4 * blocks + 2 * gates + 4 * rows + 2 * gate_rows
    assert "dry run on cpu (--device=cpu): float32 weights" in out
    assert f"params total: 1,049,560 {mib(cpu_params)}, optimizer state {mib(cpu_state)}" in out
    assert "(bfloat16)" not in out.split("on cuda instead")[0]
    assert (f"on cuda instead (bfloat16 weights): params total: 1,049,560 {mib(cuda_params)}, "
            f"optimizer state {mib(cuda_state)}") in out


def test_dry_run_for_cuda_reports_bfloat16_with_the_cpu_totals_labelled(capsys):
    out = dry_run_output(["--preset=tiny", "--device=cuda"], capsys)
    assert "dry run on cuda (--device=cuda): bfloat16 weights" in out
    assert "on cpu instead (float32 weights): params total: 1,049,560 4.0 MiB" in out


def test_dry_run_with_a_fixed_dtype_has_no_second_device_line(capsys):
    out = dry_run_output(["--preset=tiny", "--device=cpu", "--dtype=bfloat16"], capsys)
    assert "dry run on cpu (--device=cpu): bfloat16 weights" in out and "instead" not in out


# ---- seeds: every run its own, the logged one repeats a run


def config_seed(tmp_path) -> int:
    (line,) = log_lines(tmp_path, "config seed = ")
    return int(line.removeprefix("config seed = "))


def logged(tmp_path, pattern: str) -> list[str]:
    return re.findall(pattern, log_text(tmp_path), re.M)


def test_runs_without_a_seed_differ_and_the_logged_seed_repeats_a_run_bit_for_bit(synthetic_dir, tmp_path,
                                                                                  monkeypatch):
    """Different seeds give different initial weights, hence different losses once training moved
    them. The step-0 training loss barely tells: the head starts at N(0, 0.005^2) and the sigmoid
    softcap maps such logits to nearly one value, so every seed's first loss is close to that of a
    uniform prediction, ln 512 per token, summed (--train_loss_reduction=sum) over a slice's 128
    tokens with the multi-token weights 1, 0.5, 0.25 on its 128, 127 and 126 targets. The run
    repeated with the logged seed is the first bit for bit: every validation loss and every trained
    parameter (what train() returned). This is also the test that the same seed gives the same run
    (it was test_training.py's test_same_seed_gives_bit_identical_runs, three more runs of train()
    itself: main calls that same train())."""
    results, real_train = {}, tg.train

    def recording_train(config, *args, **kwargs):
        results[Path(config.log_dir).parent.name] = result = real_train(config, *args, **kwargs)
        return result

    monkeypatch.setattr(tg, "train", recording_train)
    runs = {name: tmp_path / name for name in ("first", "second", "repeat")}
    for name in ("first", "second"):
        assert tg.main(argv_with(synthetic_dir, runs[name])) == 0
    seeds = {name: config_seed(runs[name]) for name in ("first", "second")}
    assert seeds["first"] != seeds["second"]
    val = r"^step:(\d+)/4 val_loss:(\S+) "
    first, second = logged(runs["first"], val), logged(runs["second"], val)
    assert [step for step, _ in first] == [step for step, _ in second] == ["0", "2", "4"]
    assert first[1:] != second[1:] and first[1][1] != second[1][1]
    for run in ("first", "second"):
        (step0,) = logged(runs[run], r"^step0_train_loss:(\S+)$")
        assert float(step0) == pytest.approx((128 + 0.5 * 127 + 0.25 * 126) * math.log(512), rel=1e-3)

    assert tg.main(argv_with(synthetic_dir, runs["repeat"], f"--seed={seeds['first']}")) == 0
    assert config_seed(runs["repeat"]) == seeds["first"]
    assert logged(runs["repeat"], val) == first
    repeat, first_run = results["repeat"], results["first"]
    assert [h["val_loss"] for h in repeat["val_history"]] == [h["val_loss"] for h in first_run["val_history"]]
    for (name, a), b in zip(first_run["model"].named_parameters(), repeat["model"].parameters()):
        assert torch.equal(a, b), name


def test_a_vocabulary_the_synthetic_generator_refuses_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """The tiny preset generates data/synthetic/ on first use; parameters the generator refuses
    are an input error, not a traceback (nothing is generated or logged)."""
    monkeypatch.chdir(tmp_path)
    assert tg.main(["--preset=tiny", "--vocab_size=9000", "--eot_token=8999", f"--log_dir={tmp_path / 'logs'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --synthetic_data:") and "vocab_size" in err and "Traceback" not in err
    assert not (tmp_path / "logs").exists() and not (tmp_path / "data" / "synthetic").exists()
