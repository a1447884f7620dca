"""How a run ends, and what says so: SIGTERM takes Ctrl-C's path (a line, the log's last line, no
half-written checkpoint); a torchrun worker stops when its launcher is gone, whatever killed it; a
refusal every rank meets reaches the console once, from whichever rank gets there first; Python's
warnings during a run go to its log. The log's last line itself: tests/test_training.py (finished),
tests/test_inputs.py (an error, a non-finite loss); how records/ reads it: tests/test_runlogs.py."""
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from test_checkpoint import four_block_argv, log_text
from test_distributed import clean_env
from test_run_sh import alive, descendants, wait_for

import train_gpt_medium as tg

ROOT = Path(__file__).resolve().parent.parent


def last_step(body: str) -> str:
    """s/N of the last `step:` line of a log's body."""
    return [line for line in body.splitlines() if line.startswith("step:")][-1].split()[0].removeprefix("step:")


# ---- SIGTERM and Ctrl-C: one path


def test_sigterm_stops_a_run_as_ctrl_c_does_and_its_log_says_where(synthetic_dir, tmp_path, monkeypatch, capsys):
    """`kill PID` (or a batch's, a sweep's stop): exit 143 with one line, not a silent death, and the
    log's last line names the signal and the last step logged."""
    real_step = tg.Runner.train_step

    def terminated_at_step_2(self, step, batches, **kwargs):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, step, batches, **kwargs)

    monkeypatch.setattr(tg.Runner, "train_step", terminated_at_step_2)
    before = signal.getsignal(signal.SIGTERM)
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, N=4)) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ("interrupted by SIGTERM: the run stopped; its log and checkpoints so far "
                                       "are kept\n")
    body = log_text(tmp_path)
    assert last_step(body) == "2/4"
    assert body.splitlines()[-1] == "run ended: interrupted by SIGTERM at step 2/4 (exit 143)"
    assert signal.getsignal(signal.SIGTERM) is before  # main gave the signal back


def test_a_stop_during_a_save_leaves_no_half_written_checkpoint(synthetic_dir, tmp_path, monkeypatch):
    """Ctrl-C while step 4's main.pt is written: its step_000004.partial is removed, step 2's
    checkpoint stays whole, and the log says where the run was."""
    real_write, written = tg._write_durably, []

    def interrupted_at_the_fifth_file(path, obj):  # a save writes rank_000.pt, main.pt, meta.json
        written.append(path)
        if len(written) == 5:
            raise KeyboardInterrupt
        return real_write(path, obj)

    monkeypatch.setattr(tg, "_write_durably", interrupted_at_the_fifth_file)
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, "--save_every=2", N=4)) == 130
    run_dir = tmp_path / "ck" / "tiny"
    assert written[-1] == run_dir / "step_000004.partial" / "main.pt"
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_000002"]
    assert tg.validate_checkpoint(run_dir / "step_000002")["step"] == 2
    body = log_text(tmp_path)
    assert body.splitlines()[-1] == f"run ended: interrupted by SIGINT at step {last_step(body)} (exit 130)"


def test_pythons_warnings_during_a_run_are_in_its_log(synthetic_dir, tmp_path, monkeypatch):
    """A warning while the run trains (here the training itself is a stand-in that warns and is
    stopped): shown as Python shows it, and one line of the log."""
    def warning_train(*args, **kwargs):
        warnings.warn("something to know about this run", UserWarning)
        raise KeyboardInterrupt

    monkeypatch.setattr(tg, "train", warning_train)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert tg.main(four_block_argv(synthetic_dir, tmp_path, N=4)) == 130
    assert [str(w.message) for w in shown] == ["something to know about this run"]
    logged = [line for line in log_text(tmp_path).splitlines() if line.startswith("warning: ")]
    assert len(logged) == 1 and logged[0].startswith(f"warning: UserWarning: something to know about this run "
                                                     f"({__file__}:")


# ---- a worker whose launcher is gone


def test_a_worker_stops_when_its_launcher_is_gone():
    """The launcher's pid is no longer this process's parent (here: it never was): within a poll the
    main thread gets the interruption, as from SIGTERM, naming the launcher."""
    not_the_parent = os.getpid()
    with pytest.raises(tg.Interrupted, match=rf"its launcher's exit \(pid {not_the_parent}\)") as raised:
        with tg.STOPS.armed(launcher=not_the_parent):
            time.sleep(60)  # the poll (once a second) ends this long before
    assert tg.exit_code(raised.value) == 143


def test_an_error_once_the_launcher_is_gone_is_that_stop():
    """A collective fails when the other ranks have stopped (gloo: the connection closed): with the
    launcher gone, that error is the launcher's stop, not a crash of its own."""
    closed = RuntimeError("Connection closed by peer")
    with pytest.raises(tg.Interrupted, match="its launcher's exit") as raised:
        with tg.STOPS.armed(launcher=os.getpid()):
            raise closed
    assert raised.value.__cause__ is closed
    with pytest.raises(RuntimeError):  # with the launcher there, an error is an error
        with tg.STOPS.armed(launcher=os.getppid()):
            raise closed


@pytest.mark.slow
def test_a_sigkilled_torchrun_leaves_no_worker_running(synthetic_dir, tmp_path):
    """`kill -9` of torchrun (not of run.sh) left both workers training to the end as orphans: they
    stop within seconds, by the interruption's path (the log's last line names the launcher), and
    every checkpoint folder they leave is whole (a save cut short is step_N.partial, never read)."""
    argv = four_block_argv(synthetic_dir, tmp_path, "--save_every=2", N=100)
    with open(tmp_path / "out.txt", "w") as out:
        torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node=2", "train_gpt_medium.py", *argv], cwd=ROOT,
                                    env=clean_env(CUDA_VISIBLE_DEVICES=""), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    run_dir = tmp_path / "ck" / "tiny"
    workers = set()
    try:
        wait_for((run_dir / "step_000002").exists, torchrun, "checkpoint")
        workers = descendants(torchrun.pid)
        assert len(workers) == 2, workers
        torchrun.kill()
        assert torchrun.wait() == -signal.SIGKILL
        deadline = time.monotonic() + 60  # the poll, then the stop; on 2 busy cores
        while alive(workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(workers), (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        for pid in alive(workers):
            os.kill(pid, signal.SIGKILL)
    body = log_text(tmp_path)
    assert re.fullmatch(rf"run ended: interrupted by its launcher's exit \(pid {torchrun.pid}\) at step "
                        rf"{re.escape(last_step(body))} \(exit 143\)", body.splitlines()[-1]), body[-500:]
    assert "final val_loss" not in body
    for folder in run_dir.iterdir():
        if not folder.name.endswith(".partial"):
            assert tg.validate_checkpoint(folder)["step"] == int(folder.name.removeprefix("step_"))


# ---- a refusal that every rank meets


def test_a_refusal_under_torchrun_is_said_once_by_the_first_rank_to_meet_it(tmp_path, monkeypatch, capsys):
    """`torchrun --nproc_per_node=4 ... --preset tiny`: rank 3 refused first and exited, torchrun ended
    the others, and rank 0, the only one that spoke, never did. In torchrun's own layout of the launch's
    folders (its DefaultLogsSpecs), the first rank to refuse says it; the ranks after it do not."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    envs = {r: {"TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"} for r in range(4)}
    DefaultLogsSpecs(log_dir=str(tmp_path)).reify(envs)
    said = []
    for rank in (3, 0, 1):
        for name, value in dict(envs[rank], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4").items():
            monkeypatch.setenv(name, value)
        assert tg.main(["--preset=tiny", "--device=cpu"]) == 2
        said.append(capsys.readouterr().err)
    assert said == ["error: world size 4 does not divide --batch_slices=2: run 1 or 2 processes in all (nodes x "
                    "processes per node)\n", "", ""]
