"""records/ablate.py --arm: interleaved A/Bs of whole commands (script, flags, launcher settings).

Two kinds of A/B are made here. A real one: three arms through ./run.sh (the live script, the live
script with another Muon lr, and the frozen x01 script through TRAINER=) x 2 slots of 2-step tiny
runs on 4 blocks. And fake ones, with stand-in scripts that need no torch: one of this project's kind
(it takes --seed, --run_id, --log_dir) and one of upstream's kind (it reads no flags and writes
logs/<uuid>.txt under its working folder, its own source first). The fakes hang on request, so
that the sweep can be killed or interrupted mid-run. The run order is read from the logs' own
modification times, and every statistic of the report is computed again here with scipy from the
numbers parsed out of the logs.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ablate import _alive, _wait, read_csv  # noqa: E402
from test_bulk_model import FOUR_BLOCK_FLAGS  # noqa: E402
from test_distributed import ctrl_c_at_default  # noqa: E402
from test_plot import assert_png  # noqa: E402

from records import ablate, plot, runlogs, stats  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
X01 = ROOT / "records" / "x01_lineage" / "train_gpt_medium.py"
PY = shlex.quote(sys.executable)


def slot_of(log: Path) -> tuple[str, int]:
    """(arm, slot) from an A/B log's name, <arm>_slot<k>_<rest>.txt."""
    arm, slot = log.name.split("_slot")
    return arm, int(slot.split("_")[0])


def logs_by_arm(out: Path) -> dict[str, dict[int, runlogs.RunLog]]:
    """{arm: {slot: finished log}} from the arms' folders, read like any folder of logs."""
    found = {}
    for log in runlogs.read_logs(sorted(p for p in out.iterdir() if p.is_dir())):
        if log.finished:
            arm, slot = slot_of(log.path)
            found.setdefault(arm, {})[slot] = log
    return found


def launch_order(out: Path) -> list[str]:
    """<arm>_slot<k> of every finished log, ordered by when the log was last written (its run's end)."""
    logs = sorted((p for p in out.glob("*/*.txt") if runlogs.read_log(p).finished), key=lambda p: p.stat().st_mtime_ns)
    return ["%s_slot%d" % slot_of(p) for p in logs]


def started_order(out: Path) -> list[str]:
    """<arm>_slot<k> of every run by the start time its run.json records."""
    records = [(json.loads(p.read_text())["started_unix"], f"{p.parent.parent.name}_{p.parent.name}")
               for p in out.glob("*/slot*/run.json")]
    return [name for _, name in sorted(records)]


def check_report_against_scipy(out: Path, base: str, others: list[str], slots: list[int], target: float) -> None:
    """report.json's numbers, each computed again from the parsed logs with scipy and numpy."""
    report = json.loads((out / "report.json").read_text())
    logs = logs_by_arm(out)
    arms = {a["name"]: a for a in report["arms"]}
    assert report["baseline"] == base and "vs_baseline" not in arms[base]
    for name, entry in arms.items():
        times = [logs[name][k].train_time_s for k in slots]
        losses = [logs[name][k].val_loss for k in slots]
        assert entry["n"] == len(slots)
        assert entry["train_time_s"]["mean"] == pytest.approx(np.mean(times), rel=1e-12)
        assert entry["train_time_s"]["std"] == pytest.approx(np.std(times, ddof=1), rel=1e-12)
        assert entry["val_loss"]["mean"] == pytest.approx(np.mean(losses), rel=1e-12)
        assert entry["val_loss"]["std"] == pytest.approx(np.std(losses, ddof=1), rel=1e-12)
        chance = sps.norm.cdf((target - np.mean(losses)) / np.std(losses, ddof=1))
        assert entry["p_run_below_target"] == pytest.approx(chance, rel=1e-9, abs=1e-300)
        claim = sps.ttest_1samp(losses, target, alternative="less").pvalue
        assert entry["p_mean_below_target"] == pytest.approx(claim, rel=1e-9)
    for name in others:
        for metric in ("train_time_s", "val_loss"):
            a = [getattr(logs[base][k], metric) for k in slots]
            b = [getattr(logs[name][k], metric) for k in slots]
            got = arms[name]["vs_baseline"][metric]
            deltas = np.subtract(b, a)
            half = sps.t.ppf(0.975, len(slots) - 1) * deltas.std(ddof=1) / np.sqrt(len(slots))
            paired, welch = sps.ttest_rel(b, a), sps.ttest_ind(b, a, equal_var=False)
            assert got["slots"] == slots and got["deltas"] == pytest.approx(list(deltas), abs=1e-12)
            assert got["paired"]["mean_diff"] == pytest.approx(deltas.mean(), abs=1e-12)
            assert got["paired"]["ci95"] == pytest.approx([deltas.mean() - half, deltas.mean() + half], rel=1e-9)
            assert got["paired"]["t"] == pytest.approx(paired.statistic, rel=1e-9)
            assert got["paired"]["p_two_sided"] == pytest.approx(paired.pvalue, rel=1e-9)
            assert got["welch"]["diff_b_minus_a"] == pytest.approx(np.mean(b) - np.mean(a), abs=1e-12)
            assert got["welch"]["t"] == pytest.approx(welch.statistic, rel=1e-9)
            assert got["welch"]["p_two_sided"] == pytest.approx(welch.pvalue, rel=1e-9)


def verdict_word(low: float, high: float) -> str:
    return "faster" if high < 0 else "slower" if low > 0 else "no time difference shown"


# -----------------------------------------------------------------------------
# A real A/B: this script twice (two Muon lrs) and the frozen x01 script, through ./run.sh

SLOW = pytest.mark.slow  # 6 tiny runs, each a run.sh launch (about two minutes on 2 busy cores)
REAL_ARMS = ("base", "cand", "x01")


@pytest.fixture(scope="module")
def real_ab(tmp_path_factory, synthetic_dir):
    out = tmp_path_factory.mktemp("ab") / "out"
    launcher = f"PYTHON={PY} CUDA_VISIBLE_DEVICES= {shlex.quote(str(ROOT / 'run.sh'))}"
    argv = ["--preset", "tiny", "--arm", f"base={launcher}", "--arm", f"cand={launcher} --muon_lr=0.03",
            "--arm", f"x01=TRAINER=records/x01_lineage/train_gpt_medium.py {launcher}", "--seeds", "1,2",
            "--out", str(out), "--",
            # 2 steps (no extension steps, which a run must have fewer of than steps), validated at 0 and 2,
            # on 4 blocks (FOUR_BLOCKS, and block 1 attention-free as x01's block 7 is): the A/B reads a
            # run's log, its script, seed and flags, none of which needs more
            *FOUR_BLOCK_FLAGS, "--attention_free_layers=1", "--num_iterations=2", "--extension_steps=0", "--val_every=2", "--warmup_steps=0", "--val_tokens=1024",
            "--synthetic_data=false",
            f"--train_files={synthetic_dir / 'synthetic_train_*.bin'}", f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}",
            f"--token_bytes_file={synthetic_dir / 'synthetic_token_bytes.npy'}"]
    rc = ablate.main(argv)
    return dict(out=out, rc=rc, argv=argv, report=json.loads((out / "report.json").read_text()),
                report_md=(out / "report.md").read_text())


@SLOW
def test_the_arms_alternate_slot_by_slot_as_their_logs_show(real_ab):
    assert real_ab["rc"] == 0
    expected = ["base_slot1", "cand_slot1", "x01_slot1", "cand_slot2", "x01_slot2", "base_slot2"]  # slot 2 starts one arm on
    assert launch_order(real_ab["out"]) == expected
    assert started_order(real_ab["out"]) == expected


@SLOW
def test_each_arm_runs_its_own_script_and_every_arm_of_a_slot_gets_its_seed(real_ab):
    logs = logs_by_arm(real_ab["out"])
    live = runlogs.script_digest(runlogs.logged_source(ROOT / "train_gpt_medium.py"))  # with its kernels file
    assert {log.script for arm in ("base", "cand") for log in logs[arm].values()} == {live}
    assert {log.script for log in logs["x01"].values()} == {runlogs.script_digest(X01.read_text())}
    for arm in REAL_ARMS:
        assert {k: log.seed for k, log in logs[arm].items()} == {1: "1", 2: "2"}
        assert all(log.config["preset"] == "'tiny'" and log.steps == 2 for log in logs[arm].values())
    assert {log.config["muon_lr"] for log in logs["cand"].values()} == {"0.03"}
    assert {log.config["muon_lr"] for log in logs["base"].values()} != {"0.03"}


@SLOW
def test_the_real_reports_numbers_equal_scipy_on_the_logs_numbers(real_ab):
    check_report_against_scipy(real_ab["out"], "base", ["cand", "x01"], [1, 2], stats.MEDIUM_TARGET)


@SLOW
def test_the_report_gives_one_verdict_line_per_arm_and_the_slots(real_ab):
    report, md = real_ab["report"], real_ab["report_md"]
    assert len(report["verdicts"]) == 2
    for name in ("cand", "x01"):
        paired = next(a for a in report["arms"] if a["name"] == name)["vs_baseline"]["train_time_s"]["paired"]
        verdict = next(v for v in report["verdicts"] if v.startswith(name))
        assert verdict_word(*paired["ci95"]) in verdict and f"- **{verdict}.**" in md
    times = logs_by_arm(real_ab["out"])
    row = next(line for line in md.splitlines() if line.startswith("| 2 | 2 |"))
    assert row.startswith("| 2 | 2 | cand x01 base | " + f"{times['base'][2].train_time_s:.3f} |")


@SLOW
def test_stats_reads_an_arms_folder_like_any_folder_of_logs(real_ab, capsys):
    folder = real_ab["out"] / "x01"
    capsys.readouterr()
    assert stats.main([str(folder), "--json"]) == 3  # CPU runs of the tiny preset: figures, no verdict
    got = json.loads(capsys.readouterr().out)
    assert sorted(Path(r["path"]).name for r in got["runs"]) == sorted(p.name for p in folder.glob("*.txt"))
    assert len(got["runs"]) == 2 and got["warnings"] == []


@SLOW
def test_the_picture_and_the_report_only_rerun(real_ab, tmp_path):
    out = real_ab["out"]
    assert_png(out / "slots.png")
    assert plot.main(["curves", str(out), "-o", str(tmp_path / "curves.png")]) == 0  # an A/B folder is one group per arm
    before = {name: (out / name).read_text() for name in ("runs.csv", "report.md", "report.json")}
    for name in before:
        (out / name).unlink()
    assert ablate.main(["--report-only", "--out", str(out)]) == 0
    assert {name: (out / name).read_text() for name in before} == before
    rows = read_csv(out / "runs.csv")
    assert [(r["slot"], r["arm"], r["seed"], r["status"]) for r in rows][:3] == [
        ("1", "base", "1", "finished"), ("1", "cand", "1", "finished"), ("1", "x01", "1", "finished")]


# -----------------------------------------------------------------------------
# Fake A/Bs (no torch): killed, interrupted, continued

FAKE_OURS = '''"""A stand-in trainer of this project's kind, without torch: a finished log at once, or, for the
run named in hang.txt, half a log and then a long sleep."""
import hashlib
import os
import sys
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Hyperparameters:
    preset: str = "medium"
    seed: int = 0
    run_id: str = ""
    log_dir: str = "logs"
    speed: float = 1.0


def make_config(**values):
    return Hyperparameters(**values)


def parse_args(argv):
    known = {f.name for f in fields(Hyperparameters)}
    values = {}
    for arg in argv:
        name, _, value = arg[2:].partition("=")
        if name not in known:
            raise ValueError(f"unknown flag --{name}")
        values[name] = value
    return make_config(**values)


def main(argv):
    config = parse_args(argv)
    with open(HERE / "calls_ours.txt", "a") as f:
        f.write(" ".join(argv) + "\\n")
    jitter = int(hashlib.sha256(config.run_id.encode()).hexdigest()[:6], 16) / 16 ** 6  # in [0, 1), fixed per run
    seconds = float(config.speed) * (2.0 + 0.1 * int(config.seed)) + 0.3 * jitter
    loss = 3.0 + 0.05 * jitter + 0.01 * int(config.seed)
    log = Path(config.log_dir) / f"{config.run_id}_{uuid.uuid4()}.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    head = [Path(__file__).read_text(), "=" * 100, f"config preset = {config.preset!r}", f"config seed = {config.seed}",
            f"config speed = {config.speed}"]
    half = f"step:2/4 train_time:{seconds * 500:.0f}ms step_avg:{seconds * 250:.2f}ms"
    hang = HERE / "hang.txt"
    if hang.exists() and hang.read_text() == config.run_id:
        log.write_text("\\n".join(head + [half]) + "\\n")
        (HERE / "hung.pid").write_text(str(os.getpid()))
        time.sleep(300)
    end = f"step:4/4 val_loss:{loss:.6f} train_time:{seconds * 1000:.0f}ms step_avg:{seconds * 250:.2f}ms"
    log.write_text("\\n".join(head + [half, end]) + "\\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''

FAKE_UPSTREAM = '''import os
import sys

with open(sys.argv[0]) as f:
    code = f.read()  # like an upstream record script: its log starts with its own source
import uuid
from pathlib import Path

calls = Path(sys.argv[0]).resolve().parent / "calls_upstream.txt"
with open(calls, "a") as f:
    f.write(repr(sys.argv[1:]) + " " + os.environ.get("ARM_SETTING", "-") + "\\n")
n = len(calls.read_text().splitlines())
seconds, loss = 2.5 + 0.07 * (n % 3), 3.05 - 0.004 * n
os.makedirs("logs", exist_ok=True)
with open(f"logs/{uuid.uuid4()}.txt", "w") as f:
    print(code, file=f)
    print("=" * 100, file=f)
    print(f"step:4/4 val_loss:{loss:.4f} train_time:{seconds * 1000:.0f}ms step_avg:{seconds * 250:.2f}ms", file=f)
'''


def fake_ab(tmp: Path, hang: str | None = None) -> list[str]:
    """The stand-in scripts in `tmp` and the argv of an A/B of them: arm a (this project's kind,
    its own flag --speed=0.9) and arm up (upstream's kind) x 3 slots, into tmp/out."""
    ours, upstream = tmp / "fake_ours.py", tmp / "fake_upstream.py"
    ours.write_text(FAKE_OURS)
    upstream.write_text(FAKE_UPSTREAM)
    if hang:
        (tmp / "hang.txt").write_text(hang)
    return ["--preset", "tiny", "--arm", f"a={PY} {ours} --speed=0.9", "--arm", f"up={PY} {upstream}",
            "--seeds", "1,2,3", "--out", str(tmp / "out"), "--target", "3.05"]


def start_until_hung(tmp: Path, argv: list[str]) -> tuple[subprocess.Popen, int]:
    """ablate.py started as a script in `tmp`, once its hanging run is up: (the sweep, that run's pid)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "records" / "ablate.py"), *argv], cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_at_default)
    pidfile = tmp / "hung.pid"
    if not _wait(lambda: pidfile.exists() and pidfile.read_text(), 120):
        proc.kill()
        raise AssertionError(f"the hanging run never started: {proc.communicate()}")
    return proc, int(pidfile.read_text())


def ids_called(path: Path) -> list[str]:
    return [next(w for w in line.split() if w.startswith("--run_id=")).split("=", 1)[1]
            for line in path.read_text().splitlines()]


ORDER = ["a_slot1", "up_slot1", "up_slot2", "a_slot2", "a_slot3", "up_slot3"]  # A B, B A, A B


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_sigkilled_ab_leaves_no_trainer_and_its_rerun_makes_only_what_is_missing(tmp_path, monkeypatch):
    argv = fake_ab(tmp_path, hang="a_slot2")
    proc, hung = start_until_hung(tmp_path, argv)
    try:
        assert _alive(hung)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert _wait(lambda: not _alive(hung), 15), f"run {hung} outlived the sweep"
    finally:
        if _alive(hung):
            os.kill(hung, signal.SIGKILL)
    out = tmp_path / "out"
    assert launch_order(out) == ORDER[:3]
    (tmp_path / "hang.txt").unlink()
    monkeypatch.chdir(tmp_path)
    assert ablate.main(argv) == 0
    assert ids_called(tmp_path / "calls_ours.txt") == ["a_slot1", "a_slot2", "a_slot2", "a_slot3"]
    assert (tmp_path / "calls_upstream.txt").read_text().splitlines() == ["[] -"] * 3  # no flags for upstream's kind
    assert len(list((out / "a").glob("a_slot2_*.txt.incomplete"))) == 1  # the killed run's half log, set aside
    assert launch_order(out) == started_order(out) == ORDER
    assert [r["status"] for r in read_csv(out / "runs.csv")] == ["finished"] * 6


def test_each_slot_shares_one_seed_and_upstreams_logs_move_into_its_arms_folder(tmp_path, monkeypatch):
    argv = fake_ab(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert ablate.main(argv) == 0
    out = tmp_path / "out"
    calls = (tmp_path / "calls_ours.txt").read_text().splitlines()
    assert calls == [f"--speed=0.9 --preset=tiny --seed={k} --run_id=a_slot{k} --log_dir={out / 'a'}" for k in (1, 2, 3)]
    logs = logs_by_arm(out)
    assert {k: log.seed for k, log in logs["a"].items()} == {1: "1", 2: "2", 3: "3"}
    assert sorted(logs["up"]) == [1, 2, 3] and all(log.seed is None for log in logs["up"].values())
    assert not list((tmp_path / "logs").glob("*.txt"))  # every upstream log was moved, none left behind
    assert all(log.script == runlogs.script_digest(FAKE_UPSTREAM) for log in logs["up"].values())
    check_report_against_scipy(out, "a", ["up"], [1, 2, 3], 3.05)
    seeds = [r["seed"] for r in read_csv(out / "runs.csv")]
    assert seeds == ["1", "", "", "2", "3", ""]  # the seed each log reports, in launch order


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ctrl_c_ends_with_the_summary_and_the_command_that_continues(tmp_path, monkeypatch):
    argv = fake_ab(tmp_path, hang="a_slot2")
    proc, hung = start_until_hung(tmp_path, argv)
    try:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert _wait(lambda: not _alive(hung), 15), f"run {hung} outlived the interrupt"
    finally:
        if _alive(hung):
            os.kill(hung, signal.SIGKILL)
    assert proc.returncode == 130
    assert "arm a: 1 finished, train time " in stdout and "arm up: 2 finished, train time " in stdout
    assert "verdict: up against a: no verdict yet: 1 slot(s) where both finished" in stdout
    lines = stderr.splitlines()
    at = lines.index(f"interrupted: rerun the same command to continue; finished runs are kept in {tmp_path / 'out'}")
    again = shlex.split(lines[at + 1])
    assert again[0] == "python" and Path(again[1]).resolve() == ROOT / "records" / "ablate.py" and again[2:] == argv
    (tmp_path / "hang.txt").unlink()
    monkeypatch.chdir(tmp_path)
    assert ablate.main(again[2:]) == 0  # the command given, in this process
    assert ids_called(tmp_path / "calls_ours.txt") == ["a_slot1", "a_slot2", "a_slot2", "a_slot3"]
    assert [r["status"] for r in read_csv(tmp_path / "out" / "runs.csv")] == ["finished"] * 6


SLEEPER = '''import os, sys, time
open({pidfile!r}, "w").write(str(os.getpid()))
time.sleep(120)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_sigkilled_ab_leaves_no_process_that_its_run_started(tmp_path):
    """The run is a shell that started the sleeper (a grandchild of the sweep): killing the sweep
    ends the run's whole process group, the grandchild too, not only the run's first process."""
    pidfile = tmp_path / "child.pid"
    (tmp_path / "sleeper.py").write_text(SLEEPER.format(pidfile=str(pidfile)))
    shell = shlex.quote(f"{PY} {tmp_path / 'sleeper.py'}; echo after")
    argv = ["--preset", "tiny", "--arm", f"a=sh -c {shell}", "--arm", f"b=sh -c {shell}", "--seeds", "1",
            "--out", str(tmp_path / "out")]
    sweep = subprocess.Popen([sys.executable, str(ROOT / "records" / "ablate.py"), *argv], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: pidfile.exists() and pidfile.read_text(), 60), sweep.stderr.read() if sweep.poll() else ""
        child = int(pidfile.read_text())
        parent = Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[1]
        assert Path(f"/proc/{parent}/comm").read_text().strip() in ("sh", "dash", "bash")  # a grandchild indeed
        sweep.send_signal(signal.SIGKILL)
        assert sweep.wait(timeout=30) == -signal.SIGKILL
        assert _wait(lambda: not _alive(child), 15), f"{child} outlived the sweep"
    finally:
        if sweep.poll() is None:
            sweep.kill()
        if pidfile.exists() and pidfile.read_text() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


GRACEFUL = '''import os, signal, sys, time
def leave(signum, frame):
    time.sleep(1)  # like torchrun ending its workers: a while after SIGTERM
    open({marker!r}, "w").write("ended cleanly")
    sys.exit(0)
signal.signal(signal.SIGTERM, leave)
open({pidfile!r}, "w").write(str(os.getpid()))
time.sleep(120)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard waits for orphans as a Linux subreaper")
def test_a_stopped_run_gets_its_grace_period_even_after_its_first_process_is_gone(tmp_path):
    """SIGTERM to the sweep: the run's shell dies at once, but the process it started (here one
    that takes a second to end, as torchrun does with its workers) is waited for, not killed."""
    pidfile, marker = tmp_path / "child.pid", tmp_path / "ended.txt"
    (tmp_path / "graceful.py").write_text(GRACEFUL.format(pidfile=str(pidfile), marker=str(marker)))
    shell = shlex.quote(f"{PY} {tmp_path / 'graceful.py'}; echo after")
    argv = ["--preset", "tiny", "--arm", f"a=sh -c {shell}", "--arm", f"b=sh -c {shell}", "--seeds", "1",
            "--out", str(tmp_path / "out")]
    sweep = subprocess.Popen([sys.executable, str(ROOT / "records" / "ablate.py"), *argv], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: pidfile.exists() and pidfile.read_text(), 60), sweep.stderr.read() if sweep.poll() else ""
        child = int(pidfile.read_text())
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=60) == 143
        assert marker.read_text() == "ended cleanly" and not _alive(child)
    finally:
        if sweep.poll() is None:
            sweep.kill()
        if pidfile.exists() and pidfile.read_text() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


# -----------------------------------------------------------------------------
# The plan, and input an A/B cannot use (no run made, nothing written)

def test_dry_run_lists_the_alternating_runs_with_seeds_only_where_the_script_takes_them(tmp_path, capsys,
                                                                                         monkeypatch):
    argv = fake_ab(tmp_path)
    argv[argv.index("--seeds") + 1] = "5,6"
    monkeypatch.chdir(tmp_path)
    assert ablate.main([*argv, "--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    out = tmp_path / "out"
    assert lines[0::2] == ["[run 1/4] slot 1, arm a, seed 5", "[run 2/4] slot 1, arm up, no seed (its script takes none)",
                           "[run 3/4] slot 2, arm up, no seed (its script takes none)", "[run 4/4] slot 2, arm a, seed 6"]
    assert lines[1].strip() == shlex.join([sys.executable, str(tmp_path / "fake_ours.py"), "--speed=0.9", "--preset=tiny",
                                           "--seed=5", "--run_id=a_slot1", f"--log_dir={out / 'a'}"])
    assert lines[3].strip() == shlex.join([sys.executable, str(tmp_path / "fake_upstream.py")])
    assert not out.exists() and not (tmp_path / "calls_ours.txt").exists()


def test_launcher_settings_go_to_the_runs_environment(tmp_path, monkeypatch):
    """NAME=VALUE words in front of an arm's command (after `env`, or bare) are set for its runs only."""
    argv = fake_ab(tmp_path)
    argv[argv.index("--seeds") + 1] = "1"
    argv[3] = argv[3].replace("a=", "a=env ARM_SETTING=x ", 1)
    argv[5] = argv[5].replace("up=", "up=ARM_SETTING=y ", 1)
    monkeypatch.chdir(tmp_path)
    assert ablate.main(argv) == 0
    assert (tmp_path / "calls_upstream.txt").read_text().splitlines() == ["[] y"]
    made = {arm: json.loads((tmp_path / "out" / arm / "slot1" / "run.json").read_text()) for arm in ("a", "up")}
    assert made["a"]["settings"] == {"ARM_SETTING": "x"} and made["up"]["settings"] == {"ARM_SETTING": "y"}
    assert made["up"]["command"] == [sys.executable, str(tmp_path / "fake_upstream.py")]


@pytest.mark.parametrize("argv, message", [
    (["--arm", "./run.sh", "--arm", "b=./run.sh"], "error: --arm './run.sh': write NAME=COMMAND"),
    (["--arm", "my arm=./run.sh", "--arm", "b=./run.sh"], "error: --arm 'my arm=./run.sh': write NAME=COMMAND with a NAME"),
    (["--arm", "a=", "--arm", "b=./run.sh"], "error: --arm 'a=': the command is empty"),
    (["--arm", "a=./run.sh", "--arm", "a=./run.sh --muon_lr=0.03"], "error: --arm a: the name is given twice"),
    (["--arm", "a=./run.sh", "--arm", "A=./run.sh --muon_lr=0.03"], "error: --arm A: the name is given twice"),
    (["--arm", "a=./run.sh"], "error: --arm: an A/B needs two arms or more, got 1"),
    (["--arm", "a=./run.sh", "--arm", "b=./run.sh", "--grid", "lore_input=false,true"],
     "error: --arm and --grid cannot be combined"),
    (["--arm", "a=./run.sh", "--arm", "b=./run.sh", "--launcher", "./run.sh"], "error: --arm and --launcher cannot be combined"),
    (["--arm", "a=./run.sh", "--arm", "b=./run.sh", "--band-loss", "0.01"], "error: --arm and --band-loss cannot be combined"),
    (["--grid", "lore_input=false,true", "--target", "3.0"], "error: --target is for an A/B of --arm commands"),
    (["--arm", "a=./run.sh", "--arm", "b=./no_such.sh"], "error: --arm b='./no_such.sh': ./no_such.sh is not an executable here"),
    (["--arm", "a=./run.sh", "--arm", "b=TRAINER=records/nope.py ./run.sh"],
     "error: --arm b='TRAINER=records/nope.py ./run.sh': TRAINER=records/nope.py: no such script in"),
    (["--arm", "a=./run.sh", "--arm", "b=./run.sh '--recipe"], "error: --arm b=\"./run.sh '--recipe\": the command does not parse"),
    (["--arm", "a=./run.sh", "--arm", "b=RUNS=3 ./run.sh"], "error: --arm b='RUNS=3 ./run.sh': RUNS= would make run.sh repeat"),
    (["--arm", "a=./run.sh", "--arm", "b=./run.sh --seed=3"], "error: --arm b: its command sets --seed, which the A/B sets"),
    (["--arm", "a=./run.sh", "--arm", "b=./run.sh", "--", "--log_dir=x"], "error: extra trainer flag '--log_dir=x': the A/B sets"),
    (["--arm", "a=./run.sh", "--arm", "b=./run.sh --muon_lrr=0.03"], "error: --arm b: unknown flag --muon_lrr; did you mean"),
    (["--arm", "a=./run.sh", "--arm", "b=./run.sh", "--baseline", "c"], "error: --baseline 'c' is not an arm; arms: a, b"),
])
def test_an_unusable_ab_is_one_line_and_exit_2_before_any_run(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    code = ablate.main(["--preset", "tiny", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_flags_after_the_double_dash_cannot_reach_a_script_of_upstreams_kind(tmp_path, capsys, monkeypatch):
    argv = fake_ab(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert ablate.main([*argv, "--", "--num_iterations=50"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --arm up: its script {tmp_path / 'fake_upstream.py'} takes no flags of this project")
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_finished_log_of_another_script_version_blocks_the_rerun(tmp_path, capsys, monkeypatch):
    argv = fake_ab(tmp_path)
    argv[argv.index("--seeds") + 1] = "1,2"
    monkeypatch.chdir(tmp_path)
    assert ablate.main(argv) == 0
    (tmp_path / "fake_upstream.py").write_text(FAKE_UPSTREAM + "# edited\n")
    capsys.readouterr()
    assert ablate.main(argv) == 2
    err = capsys.readouterr().err
    assert f"was made by another version of {tmp_path / 'fake_upstream.py'}" in err and len(err.splitlines()) == 1
    assert len((tmp_path / "calls_upstream.txt").read_text().splitlines()) == 2


def test_a_script_that_writes_no_log_is_a_failed_run_that_says_where_it_looked(tmp_path, monkeypatch):
    argv = fake_ab(tmp_path)
    argv[argv.index("--seeds") + 1] = "1"
    (tmp_path / "fake_upstream.py").write_text(FAKE_UPSTREAM.replace('f"logs/{uuid.uuid4()}.txt"', '"elsewhere.txt"'))
    monkeypatch.chdir(tmp_path)
    assert ablate.main(argv) == 1
    row = next(r for r in read_csv(tmp_path / "out" / "runs.csv") if r["arm"] == "up")
    assert row["reason"] == (f"exit 0 but no finished log (no log of {tmp_path / 'fake_upstream.py'} appeared in "
                             f"{tmp_path / 'logs'})")


def test_a_failed_runs_reason_is_its_error_line_not_the_launchers_report_after_it(tmp_path, monkeypatch):
    """torchrun follows a rank's `error: ...` with its own report (lines of `=`): the reason is the error."""
    script = shlex.quote("echo 'error: --train_files: too few shards' >&2; echo '=====' >&2; exit 1")
    monkeypatch.chdir(tmp_path)
    argv = ["--preset", "tiny", "--arm", f"a=sh -c {script}", "--arm", f"b=sh -c {script}", "--seeds", "1",
            "--out", str(tmp_path / "out")]
    assert ablate.main(argv) == 1
    assert [r["reason"] for r in read_csv(tmp_path / "out" / "runs.csv")] == [
        "exit 1: error: --train_files: too few shards"] * 2
