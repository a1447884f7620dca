"""Shared fixtures: the repository (and tests/golden) on sys.path, tiny configurations, and the
tiny preset's run at --seed=0, made once per session."""
import fcntl
import importlib.metadata
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Python's bytecode cache on for the session and every process it starts (__pycache__/ is in .gitignore),
# even where PYTHONDONTWRITEBYTECODE is set: otherwise each of the suite's ~100 Python processes compiles
# the trainer's 7,000 lines and each test module from source (about 40 s of CPU in all, measured).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "golden"))

import make_golden  # noqa: E402
import train_gpt_medium as tg  # noqa: E402

# One thread per process unless OMP_NUM_THREADS says otherwise: the suite's in-process runs and
# the processes it starts then keep their speed when another program takes a core (README, "CPU
# threads"); the trainer's CPU default is the same.
if not os.environ.get("OMP_NUM_THREADS"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# The files that cost the most CPU time (pytest --durations on 2 cores), longest first. Two workers take
# whole files (--dist=loadfile) in the order given: a long file taken last would keep one worker busy
# while the other sits idle (test_x01_lineage.py's frozen 200-step run, 2 minutes, was taken late when
# xdist ordered files by their number of tests). The rest follow in their usual order.
LONGEST_FILES_FIRST = ("test_x01_lineage.py", "test_gpu_path.py", "test_bench.py", "test_frontier_recipes.py",
                       "test_bulk_model.py", "test_ablate_ab.py", "test_ablate.py", "test_run_sh.py",
                       "test_fused_ce.py", "test_distributed.py", "test_transfer_recipe.py", "test_mudd_gate.py")


def pytest_configure(config):
    """xdist hands out files in collection order (pytest_collection_modifyitems' below), not by their
    number of tests (its default since 3.6; an older xdist has no such option and keeps the order)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


@pytest.fixture
def refusal_of(capsys):
    """refusal_of(*flags): the one line a tiny dry run with these flags is refused with (exit 2)."""
    def refused(*flags: str) -> str:
        assert tg.main(["--preset=tiny", "--dry_run", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err
    return refused


@pytest.fixture
def tiny_config():
    """The tiny preset's model (fp32 on CPU), with no data files attached."""
    return tg.make_config("tiny", dtype="float32")


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    """A small synthetic dataset (same generator as the tiny preset), written once per session."""
    sys.path.insert(0, str(ROOT / "data"))
    import synthetic
    out = tmp_path_factory.mktemp("synthetic")
    synthetic.write_dataset(out, vocab_size=500, eot_token=499, seed=7, train_shards=2, shard_tokens=60_000,
                            val_tokens=16_384)
    return out


# The tiny run in a process of its own (tiny_seed0_run_started): what it prints is kept with its result.
TINY_RUN_PROCESS = """
import os, pickle, sys, threading, time, traceback
from pathlib import Path
root, folder, saved, parent = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])

def orphaned():  # the test session is gone: so is the run
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)
threading.Thread(target=orphaned, daemon=True).start()
sys.path[:0] = [root, os.path.join(root, "tests", "golden")]
try:
    import torch
    torch.set_num_threads(1)
    import make_golden
    tmp = saved.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(make_golden.quiet_tiny_run(Path(folder))))
    os.replace(tmp, saved)
except BaseException:
    saved.with_suffix(".failed").write_text(traceback.format_exc())
    raise
"""


def running(pid: str) -> bool:
    """Whether process `pid` runs (a finished one not yet reaped by its parent, a zombie, does not)."""
    try:
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def tiny_run_files(tmp_path_factory) -> tuple[Path, Path]:
    """(the saved result, the lock file) of the session's tiny run, in the session's temporary folder,
    which the xdist workers share."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # each worker's folder sits in the session's
    return shared / "tiny_seed0_run.pickle", shared / "tiny_seed0_run.lock"


@pytest.fixture(scope="session", autouse=True)
def tiny_seed0_run_started(request, tmp_path_factory):
    """Under pytest-xdist, when the session has tests that need tiny_seed0_run, the first worker to
    start begins it in a process of its own: the worker goes on with its tests, and no worker later
    sits idle while another makes the run (a test that needs it waits only for what is left)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not any(
            "tiny_seed0_run" in item.fixturenames for item in request.session.items):
        yield
        return
    saved, lock_path = tiny_run_files(tmp_path_factory)
    process = None
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = saved.with_suffix(".started")
        if not saved.exists() and not started.exists():
            folder = tmp_path_factory.mktemp("tiny_seed0")
            with open(saved.with_suffix(".stderr"), "w") as stderr:
                process = subprocess.Popen([sys.executable, "-c", TINY_RUN_PROCESS, str(ROOT), str(folder),
                                            str(saved), str(os.getpid())], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                           stdout=subprocess.DEVNULL, stderr=stderr)
            started.write_text(str(process.pid))
    yield
    if process is not None:  # the run outlives no session: its last users may still be reading it
        process.wait(timeout=600)


@pytest.fixture(scope="session")
def tiny_seed0_run(tmp_path_factory):
    """The README's first command, `--preset tiny --seed=0` on one thread, from the repository root
    (its data generated into data/synthetic/ if missing). One run serves every test that needs a
    whole tiny training run: the golden numbers, the log format, learning. Under pytest-xdist it
    runs in a process of its own from the session's start (tiny_seed0_run_started) and a test waits
    for its saved result; elsewhere it runs in this process (the session's temporary folder is shared
    by the workers). Returns what train() returned, the log's path and what the run printed."""
    saved, lock_path = tiny_run_files(tmp_path_factory)
    started, failed = saved.with_suffix(".started"), saved.with_suffix(".failed")
    while started.exists() and not saved.exists():  # the run of tiny_seed0_run_started, under way
        if failed.exists():
            raise RuntimeError(f"the session's tiny run failed:\n{failed.read_text()}")
        if not running(started.read_text()):
            break  # it ended without a result: made here instead
        time.sleep(0.5)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if saved.exists():
            return pickle.loads(saved.read_bytes())
        run = make_golden.quiet_tiny_run(tmp_path_factory.mktemp("tiny_seed0"))
        saved.write_bytes(pickle.dumps(run))
        return run


def triton_interpreter_conflict() -> str:
    """Why triton's interpreter (TRITON_INTERPRET=1, the kernel tests of tests/test_fused_ce.py) cannot
    run with this numpy, or "": triton before 3.7 turns a kernel's scalar argument into an int with
    int() of a 1-element array, which numpy 2.4 refuses (requirements-gpu-stack.txt)."""
    try:
        triton_version = importlib.metadata.version("triton")  # its version only: importing it is slow
    except importlib.metadata.PackageNotFoundError:
        return ""
    major_minor = lambda version: tuple(int(part) for part in version.split(".")[:2])
    numpy_version = importlib.metadata.version("numpy")
    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (f"triton {triton_version}'s interpreter fails with numpy {numpy_version}: the Triton kernel "
                "tests in tests/test_fused_ce.py error; install numpy<2.4 with it (requirements-gpu-stack.txt)")
    return ""


def pytest_terminal_summary(terminalreporter):
    """Say at the end of the run how the golden files were compared on this machine (bit for bit,
    or within the tolerance on a machine kind without an entry), and when this numpy breaks triton's
    interpreter (the kernel tests' errors then say only "only 0-dimensional arrays ...")."""
    notes = [value for key in ("passed", "failed") for report in terminalreporter.stats.get(key, [])
             for name, value in getattr(report, "user_properties", []) if name == "golden_comparison"]
    for note in notes:
        terminalreporter.write_line(f"golden files: {note}")
    conflict = triton_interpreter_conflict()
    if conflict:
        terminalreporter.write_line(f"warning: {conflict}")


@pytest.fixture(scope="session")
def trained_tiny_checkpoint(tiny_seed0_run, tmp_path_factory):
    """The tiny run at --seed=0 (tiny_seed0_run), a model of the synthetic data, saved as a checkpoint
    at its last step (step_000190): what the after-run tools (sample, HellaSwag, export) read."""
    config = tg.make_config("tiny", seed=0, checkpoint_dir=str(tmp_path_factory.mktemp("trained") / "ck"),
                            train_files=str(ROOT / tg.PRESETS["tiny"]["train_files"]))
    runner = tg.Runner(config, torch.device("cpu"))
    runner.model.load_state_dict(tiny_seed0_run["result"]["model"].state_dict())
    loader = tg.train_loader(config, tg.shard_files(config.train_files, "train_files"), 0, 1, torch.device("cpu"))
    return tg.save_checkpoint(runner, loader, config.num_iterations, tiny_seed0_run["result"]["train_time_ms"])
