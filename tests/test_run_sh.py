"""run.sh at its edges: bad counts and world sizes are refused before anything starts, every run
of a batch saves into a checkpoint folder of its own (and one of them resumes from it), Ctrl-C ends
a batch with its summary and the command that continues it, a continued batch counts the runs
already in its folder, and a SIGKILLed run.sh leaves no trainer or torchrun worker behind.

The tests of the flags run.sh passes use a stand-in for $PYTHON; the stops and kills are real tiny
runs (CPU, gloo for 2 processes) of the bulk layout in 4 blocks (FOUR_BLOCK_FLAGS): what a signal
does to run.sh, torchrun and the trainer does not depend on the model's depth."""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bulk_model import FOUR_BLOCK_FLAGS
from test_checkpoint import log_text, run_argv
from test_claim_flow import FAKE_TRAINER
from test_distributed import clean_env, ctrl_c_at_default
from test_records import fake_python, run_sh, trainer_calls

import train_gpt_medium as tg

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE_ERROR = ("error: world size 3 does not divide --batch_slices=2: run 1 or 2 processes in all "
                    "(nodes x processes per node)")


def has_pdeathsig() -> bool:
    return subprocess.run(["setpriv", "--pdeathsig", "TERM", "true"], capture_output=True).returncode == 0 \
        if shutil.which("setpriv") else False


# ---- refused before anything starts


@pytest.mark.parametrize("value", ["", "ten", "0"])
def test_a_bad_runs_count_is_refused_set_but_empty_too(tmp_path, value):
    python, calls = fake_python(tmp_path)
    proc = run_sh(tmp_path, python, ["--preset", "tiny"], RUNS=value)
    assert proc.returncode == 2 and not calls.exists()
    assert proc.stderr == f"error: RUNS={value}: give the number of runs as a positive integer, e.g. RUNS=10\n"


@pytest.mark.parametrize("value", ["abc", "", "-1", "2x", "08"])
def test_a_bad_process_count_is_refused(tmp_path, value):
    python, calls = fake_python(tmp_path)
    proc = run_sh(tmp_path, python, ["--preset", "tiny"], NPROC_PER_NODE=value)
    assert proc.returncode == 2 and not calls.exists()
    assert proc.stderr.startswith(f"error: NPROC_PER_NODE={value}: give the number of processes on this node as a "
                                  "non-negative integer") and proc.stderr.count("\n") == 1


def test_a_world_size_that_does_not_divide_the_slices_is_refused_before_torchrun(tmp_path):
    """With the trainer's own line, every time: no torchrun, so no rank's refusal can be cut off."""
    env = clean_env(NPROC_PER_NODE="3")
    proc = subprocess.run(["./run.sh", "--preset", "tiny", f"--log_dir={tmp_path / 'logs'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", WORLD_SIZE_ERROR + "\n")
    assert not (tmp_path / "logs").exists()


# A script of upstream's kind: no parse_args, and it trains as it is imported (here: it notes where).
FOREIGN_TRAINER = '''import os
with open(os.environ["MARKS"], "a") as f:
    f.write(os.environ.get("RANK", "imported outside torchrun") + "\\n")
'''


def test_a_trainer_of_another_kind_is_not_imported_before_torchrun(tmp_path):
    """The check before torchrun imports only a trainer of this project's kind: upstream's record
    scripts (TRAINER=their script) would train right there, in one process without torchrun."""
    script, marks = tmp_path / "their_train_gpt.py", tmp_path / "marks.txt"
    script.write_text(FOREIGN_TRAINER)
    env = clean_env(NPROC_PER_NODE="2", TRAINER=str(script), MARKS=str(marks), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([str(ROOT / "run.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(marks.read_text().splitlines()) == ["0", "1"]  # the two ranks of torchrun, nothing before them


def test_the_trainer_ends_a_ctrl_c_with_one_line(monkeypatch, capsys):
    def interrupted(config, rank):
        raise KeyboardInterrupt
    monkeypatch.setattr(tg, "run_training", interrupted)
    assert tg.main(["--preset=tiny"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err == "interrupted (Ctrl-C): the run stopped; its log and checkpoints so far are kept\n"


# ---- a batch's checkpoints and its continuation (the trainer's stand-in)


@pytest.fixture
def logging_python(tmp_path):
    """A $PYTHON for run.sh that notes every call's arguments in calls.txt; train_gpt_medium.py runs the
    stand-in trainer of test_claim_flow.py (a finished log into --log_dir), anything else the real one."""
    trainer, calls = tmp_path / "fake_trainer.py", tmp_path / "calls.txt"
    trainer.write_text(FAKE_TRAINER)
    script = tmp_path / "python"
    script.write_text(f'#!/usr/bin/env bash\necho "$*" >> {shlex.quote(str(calls))}\n'
                      f'if [ "$1" = train_gpt_medium.py ]; then shift; '
                      f'exec {shlex.quote(sys.executable)} {shlex.quote(str(trainer))} "$@"; fi\n'
                      f'exec {shlex.quote(sys.executable)} "$@"\n')
    script.chmod(0o755)
    return script, calls


def test_each_run_of_a_batch_saves_into_a_folder_of_its_own(tmp_path, logging_python):
    """Under the user's --checkpoint_dir (which run.sh replaces), <batch folder>/run_<k>; a run that
    does not save, or resumes, keeps the user's flags."""
    python, calls = logging_python
    folder = tmp_path / "batch"
    proc = run_sh(tmp_path, python, ["--preset=tiny", "--checkpoint_dir", str(tmp_path / "ck"), "--save_every=2",
                                     f"--log_dir={folder}"], RUNS="2")
    assert proc.returncode == 0, proc.stderr
    assert trainer_calls(calls) == [f"train_gpt_medium.py --preset=tiny --save_every=2 --log_dir={folder} "
                                    f"--checkpoint_dir={tmp_path / 'ck' / 'batch' / f'run_{k}'}" for k in (1, 2)]
    assert f"run.sh: starting run 2 of 2 (checkpoints: {tmp_path / 'ck' / 'batch' / 'run_2'}/)" in proc.stderr
    calls.unlink()
    for flags in (["--save_every=0"], ["--save_every=2", "--resume=latest"]):
        args = ["--preset=tiny", f"--checkpoint_dir={tmp_path / 'ck'}", *flags, f"--log_dir={tmp_path / 'other'}"]
        assert run_sh(tmp_path, python, args, RUNS="1").returncode == 0
        assert trainer_calls(calls)[-1] == shlex.join(["train_gpt_medium.py", *args])


def test_a_continued_batch_counts_the_runs_already_in_its_folder(tmp_path, logging_python):
    python, calls = logging_python
    folder = tmp_path / "batch"
    args = ["--preset=tiny", f"--log_dir={folder}", "--save_every=2", f"--checkpoint_dir={tmp_path / 'ck'}"]
    assert run_sh(tmp_path, python, args, RUNS="2").returncode == 0
    proc = run_sh(tmp_path, python, args, RUNS="3")
    assert proc.returncode == 0, proc.stderr
    assert f"run.sh: 3 run(s) into {folder}/ (continuing its batch: 2 log(s) there)" in proc.stderr
    # the new runs' checkpoint folders follow the earlier runs'
    assert [c.rsplit("/", 1)[1] for c in trainer_calls(calls)] == [f"run_{k}" for k in (1, 2, 3, 4, 5)]
    out = proc.stdout.splitlines()
    assert f"batch: {folder}: 5 finished run(s) of 5 asked (2 of them before this call)" in out
    assert out[-1] == f"next: python records/stats.py {folder} --time-vs bulk"  # all five
    assert len(list(folder.glob("*.txt"))) == 5


def test_the_continue_line_repeats_the_launch_environment_that_defines_the_run(tmp_path):
    """A 2-process batch on 2 nodes that stopped would have continued as 1 process on 1 node: the
    variables run.sh reads (interpreter, script, processes, GPUs, nodes) come before the command, as
    they were set (set but empty too); those not set stay unset."""
    python = tmp_path / "python"  # records/summary.py runs; the launch of the first run fails (exit 7)
    python.write_text(f'#!/usr/bin/env bash\nif [ "$1" = records/summary.py ]; then exec {shlex.quote(sys.executable)} '
                      f'"$@"; fi\ncase "$2" in *torch.distributed.run*) exit 7 ;; esac\nexit 0\n')
    python.chmod(0o755)
    args = ["--preset=tiny", f"--log_dir={tmp_path / 'batch'}"]
    launch = dict(PYTHON=str(python), TRAINER="train_gpt_medium.py", NPROC_PER_NODE="2", CUDA_VISIBLE_DEVICES="",
                  NNODES="2", NODE_RANK="1", MASTER_ADDR="node 0", MASTER_PORT="29511")
    env = {**clean_env(RUNS="2"), **launch}
    proc = subprocess.run(["./run.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert shlex.split(proc.stdout.splitlines()[-1]) == ["continue:", "RUNS=2", *map("=".join, launch.items()),
                                                         "./run.sh", *args]
    env = {k: v for k, v in clean_env(RUNS="2", PYTHON=str(python), NPROC_PER_NODE="2").items()
           if k not in ("TRAINER", "CUDA_VISIBLE_DEVICES")}
    proc = subprocess.run(["./run.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert shlex.split(proc.stdout.splitlines()[-1]) == ["continue:", "RUNS=2", f"PYTHON={python}", "NPROC_PER_NODE=2",
                                                         "./run.sh", *args]


# ---- stopping a batch: real tiny runs


@pytest.fixture
def start(tmp_path):
    """start(args, nproc, runs): ./run.sh as a terminal's foreground job, a process group of its own,
    output in tmp_path/out.txt. Whatever of it a failed test leaves running is killed afterwards."""
    started = []

    def launch(args, nproc, runs):
        env = clean_env(RUNS=str(runs), NPROC_PER_NODE=str(nproc), CUDA_VISIBLE_DEVICES="")
        with open(tmp_path / "out.txt", "w") as out:
            started.append(subprocess.Popen(["./run.sh", *args], cwd=ROOT, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=ctrl_c_at_default))
        return started[-1]
    yield launch
    for process in started:
        for pid in alive(descendants(process.pid) | {process.pid}):
            os.kill(pid, signal.SIGKILL)
        process.wait()


def wait_for(ready, process, what):
    deadline = time.monotonic() + 120
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


def processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, state)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        out[int(entry.name)] = (int(ppid), state)
    return out


def descendants(pid: int) -> set[int]:
    table, found = processes(), {pid}
    while True:
        more = {p for p, (parent, _) in table.items() if parent in found} - found
        if not more:
            return found - {pid}
        found |= more


def alive(pids) -> set[int]:
    table = processes()
    return {p for p in pids if p in table and table[p][1] != "Z"}


@pytest.mark.parametrize("nproc", [0, 2])
def test_ctrl_c_ends_a_batch_with_its_summary_and_the_command_that_continues_it(synthetic_dir, tmp_path, start,
                                                                                nproc):
    args = run_argv(synthetic_dir, tmp_path, *FOUR_BLOCK_FLAGS, N=100)
    process = start(args, nproc, runs=3)
    wait_for(lambda: re.search(r"^step:2/100 val_loss", (tmp_path / "out.txt").read_text(), re.M), process,
             "training step")
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert process.wait(timeout=120) == 130
    out = (tmp_path / "out.txt").read_text()
    assert "Traceback" not in out
    assert out.count("interrupted (Ctrl-C): the run stopped") == 1
    assert "run.sh: interrupted in run 1 of 3; not starting the remaining 2" in out
    assert f"batch: {tmp_path / 'logs'}: 0 finished run(s) of 3 asked, 1 unfinished log(s)" in out
    last = out.splitlines()[-1]
    assert shlex.split(last) == ["continue:", "RUNS=3", f"PYTHON={sys.executable}", f"NPROC_PER_NODE={nproc}",
                                 "CUDA_VISIBLE_DEVICES=", "./run.sh", *args]


@pytest.mark.skipif(not has_pdeathsig(), reason="needs util-linux setpriv --pdeathsig")
@pytest.mark.parametrize("nproc", [0, 2])
def test_a_sigkilled_run_sh_leaves_no_process_and_its_run_resumes_from_its_own_folder(synthetic_dir, tmp_path,
                                                                                     start, nproc):
    # far more steps than the kill takes to end the run (at its step-2 checkpoint); the 1-process run is
    # then resumed from step 2 (or 4), 16 to 18 steps before its end (4-block steps: a few seconds, as
    # the 16-block run's 8 took)
    steps = 100 if nproc else 20
    args = run_argv(synthetic_dir, tmp_path, "--save_every=2", *FOUR_BLOCK_FLAGS, N=steps)
    process = start(args, nproc, runs=2)
    run_dir = tmp_path / "ck" / "logs" / "run_1"
    wait_for((run_dir / "tiny" / "step_000002").exists, process, "checkpoint")
    children = descendants(process.pid)
    assert children, "run.sh started nothing"
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 60  # torchrun gives its workers a moment before it kills them
    while alive(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(children), (tmp_path / "out.txt").read_text()[-3000:]
    # ended by the kill, not by finishing the run
    assert "final val_loss" not in log_text(tmp_path) and not (run_dir / "tiny" / f"step_{steps:06d}").exists()
    if nproc:
        return
    # resuming that run of the batch, as the README says: alone, into the batch's log folder
    flags = [f"--checkpoint_dir={run_dir}" if a.startswith("--checkpoint_dir=") else a for a in args]
    resume = subprocess.run(["./run.sh", *flags, "--resume", "latest"], cwd=ROOT,
                            env=clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert re.search(rf"resumed from {re.escape(str(run_dir))}/tiny/step_0000(\d\d) at step", log_text(tmp_path))
    assert (run_dir / "tiny" / f"step_{steps:06d}").exists()
