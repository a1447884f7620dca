"""records/ablate.py (seed-matched sweeps) and records/stats.py's paired_test.

The sweep test trains for real: a 2 x 2 grid (lore_input x lore_output) x 2 seeds of 2-step tiny runs
on 4 blocks, through a launcher wrapper that counts its calls and, the first time, crashes from the
sixth call on.
Expected statistics are computed here with scipy from the CSV's numbers. LoRE runs on the record
untied from the start (--untie_embed_after_step=0: the record's head doubles as its input table
until the split), so every sweep here passes that extra trainer flag.
"""

import contextlib
import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as sps

import train_gpt_medium as tg

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bulk_model import FOUR_BLOCK_FLAGS  # noqa: E402
from test_plot import assert_png, write_run_log  # noqa: E402

from records import ablate, plot, stats  # noqa: E402

GRID = ["--grid", "lore_input=false,true", "--grid", "lore_output=false,true"]
UNTIED = "--untie_embed_after_step=0"  # what LoRE needs on the record
BASE, IN, OUT, BOTH = ("lore_input-false__lore_output-false", "lore_input-true__lore_output-false",
                       "lore_input-false__lore_output-true", "lore_input-true__lore_output-true")

# A launcher that logs each call's trainer flags to CALLS, then either has the run made by the sweep's
# TRAINER_SERVER (a fork of a process that imported torch and the trainer once: the launcher imports
# neither; a sweep's runs are what it reads, not how a process starts, and run.sh launches are
# test_ablate_ab.py's) or, once FAIL_AFTER calls were made (0: never), crashes before training.
WRAPPER = '''import json, os, socket, sys
calls, fail_after, server, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
with open(calls, "a") as f:
    f.write(" ".join(flags) + "\\n")
if fail_after and sum(1 for _ in open(calls)) > fail_after:
    sys.exit("simulated crash")
with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
    conn.connect(server)
    request = dict(flags=flags, cwd=os.getcwd(), env=dict(os.environ))
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    sys.exit(int(conn.recv(16) or b"1"))
'''

# The sweep's trainer server: imports the trainer, then forks a child per request that takes the
# launcher's stdin, stdout, stderr, folder and environment, runs main(flags) and exits with its code,
# which goes back to the launcher. It ends with its parent (the test session).
TRAINER_SERVER = '''import ctypes, json, os, signal, socket, sys, traceback
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
root, path = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import train_gpt_medium
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
server.bind(path + ".tmp")
server.listen()
os.rename(path + ".tmp", path)  # ready
while True:
    conn, _ = server.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        server.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        try:
            code = train_gpt_medium.main(request["flags"])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
    conn.close()
'''


def launcher(tmp, calls, fail_after=0, server=""):
    """The WRAPPER's command; the tests that run nothing (refusals, --dry_run) need no server."""
    script = tmp / "wrapper.py"
    script.write_text(WRAPPER)
    return shlex.join([sys.executable, str(script), str(calls), str(fail_after), str(server)])


@contextlib.contextmanager
def trainer_server(tmp):
    """A TRAINER_SERVER for launcher(server=...): yields its socket's path."""
    path = tmp / "trainer.sock"
    process = subprocess.Popen([sys.executable, "-c", TRAINER_SERVER, str(ROOT), str(path)],
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        while not path.exists():
            assert process.poll() is None, "the trainer server ended before it was ready"
            time.sleep(0.05)
        yield path
    finally:
        process.kill()
        process.wait()


def calls_made(path):
    """(arm, seed) of every launcher call, in order, from the run ids in the logged flags."""
    if not path.exists():
        return []
    ids = [next(f for f in line.split() if f.startswith("--run_id=")) for line in path.read_text().splitlines()]
    return [(i.split("=", 1)[1].rsplit("_s", 1)[0], int(i.rsplit("_s", 1)[1])) for i in ids]


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


# -----------------------------------------------------------------------------
# The real sweep (module scope: 8 training runs in all)

@pytest.fixture(scope="module")
def sweep(tmp_path_factory, synthetic_dir):
    """The sweep interrupted after 5 runs, then rerun to completion; what each round left behind."""
    tmp = tmp_path_factory.mktemp("sweep")
    out = tmp / "out"
    # 2 steps (no extension steps, which a run must have fewer of than steps), validated at 0 and 2, on 4
    # blocks (FOUR_BLOCKS: LoRE's tables are the input's and the head's, whatever the depth): what the
    # sweep reads of a run (its log's numbers, the seed, the arm's parameters) does not need more
    trainer = [UNTIED, *FOUR_BLOCK_FLAGS, "--num_iterations=2", "--extension_steps=0", "--val_every=2", "--warmup_steps=0",
               "--val_tokens=1024", "--synthetic_data=false",
               f"--train_files={synthetic_dir / 'synthetic_train_*.bin'}", f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}",
               f"--token_bytes_file={synthetic_dir / 'synthetic_token_bytes.npy'}"]
    argv = ["--preset", "tiny", *GRID, "--seeds", "1,2", "--out", str(out), "--band-loss", "0.01", "--band-time", "1.5"]
    with trainer_server(tmp) as server:
        first_rc = ablate.main([*argv, "--launcher", launcher(tmp, tmp / "calls1.txt", 5, server), "--", *trainer])
        first_csv = read_csv(out / "runs.csv")
        second_rc = ablate.main([*argv, "--launcher", launcher(tmp, tmp / "calls2.txt", 0, server), "--", *trainer])
    return dict(out=out, first_rc=first_rc, first_csv=first_csv, first_calls=calls_made(tmp / "calls1.txt"),
                second_rc=second_rc, second_calls=calls_made(tmp / "calls2.txt"), csv=read_csv(out / "runs.csv"),
                report=json.loads((out / "report.json").read_text()), report_md=(out / "report.md").read_text())


SLOW = pytest.mark.slow  # the sweep fixture trains 8 times (about a minute on 2 cores)


@SLOW
def test_runs_are_seed_major_and_every_arm_of_a_seed_gets_that_seed(sweep):
    calls = sweep["first_calls"]
    assert [seed for _, seed in calls] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert sorted(arm for arm, _ in calls[:4]) == sorted(arm for arm, _ in calls[4:]) == sorted([BASE, IN, OUT, BOTH])
    assert calls[4][0] != calls[0][0]  # the second seed's block starts at another arm


@SLOW
def test_a_crashed_run_is_recorded_as_failed_with_its_reason_and_the_sweep_goes_on(sweep):
    assert sweep["first_rc"] == 1
    status = [row["status"] for row in sweep["first_csv"]]
    assert status == ["finished"] * 5 + ["failed"] * 3  # the wrapper crashed calls 6..8, each was still tried
    assert all(row["reason"] == "exit 1: simulated crash" for row in sweep["first_csv"][5:])


@SLOW
def test_rerun_launches_only_the_runs_that_did_not_finish(sweep):
    assert sweep["second_rc"] == 0
    assert sweep["second_calls"] == sweep["first_calls"][5:]
    assert [row["status"] for row in sweep["csv"]] == ["finished"] * 8


@SLOW
def test_csv_rows_carry_each_logs_numbers(sweep):
    for row in sweep["csv"]:
        metrics, _ = ablate.read_run(Path(row["log"]))
        assert Path(row["log"]).parent == sweep["out"] / "logs" / row["arm"] / f"seed{row['seed']}"
        for column in ("val_loss", "val_bpb", "step0_train_loss", "train_time_s", "package_time_s"):
            assert float(row[column]) == getattr(metrics, column), column
        assert int(row["params_total"]) == metrics.params_total and int(row["peak_memory_mib"]) > 0
    params = {row["arm"]: int(row["params_total"]) for row in sweep["csv"]}
    assert params[IN] < params[BASE] and params[OUT] < params[BASE]  # LoRE saves parameters


def _by_arm(rows, column):
    out = {}
    for row in rows:
        out.setdefault(row["arm"], {})[int(row["seed"])] = float(row[column])
    return out


@SLOW
@pytest.mark.parametrize("column", ["val_loss", "val_bpb", "train_time_s"])
def test_report_tests_equal_scipy_on_the_csv_numbers(sweep, column):
    values = _by_arm(sweep["csv"], column)
    arms = {a["name"]: a for a in sweep["report"]["arms"]}
    assert sweep["report"]["baseline"] == BASE and "vs_baseline" not in arms[BASE]
    base = [values[BASE][s] for s in (1, 2)]
    for arm in (IN, OUT, BOTH):
        cand = [values[arm][s] for s in (1, 2)]
        got = arms[arm]["vs_baseline"][column]
        paired, welch = sps.ttest_rel(cand, base), sps.ttest_ind(cand, base, equal_var=False)
        deltas = np.subtract(cand, base)
        half = sps.t.ppf(0.975, 1) * deltas.std(ddof=1) / np.sqrt(2)
        assert got["deltas"] == pytest.approx(list(deltas), abs=1e-12)
        assert got["paired"]["t"] == pytest.approx(paired.statistic, rel=1e-9)
        assert got["paired"]["p_two_sided"] == pytest.approx(paired.pvalue, rel=1e-9)
        assert got["paired"]["ci95"] == pytest.approx([deltas.mean() - half, deltas.mean() + half], rel=1e-9)
        assert got["welch"]["t"] == pytest.approx(welch.statistic, rel=1e-9)
        assert got["welch"]["p_two_sided"] == pytest.approx(welch.pvalue, rel=1e-9)


@SLOW
def test_report_markdown_shows_the_paired_and_welch_p_values(sweep):
    values = _by_arm(sweep["csv"], "val_loss")
    base, cand = [values[BASE][s] for s in (1, 2)], [values[IN][s] for s in (1, 2)]
    row = next(line for line in sweep["report_md"].splitlines() if line.startswith("| `lore_input=true lore_output=false`")
               and line.count("|") == 11)
    assert f"| {sps.ttest_rel(cand, base).pvalue:.4g} |" in row
    assert f"| {sps.ttest_ind(cand, base, equal_var=False).pvalue:.4g} |" in row
    assert f"{np.mean(cand) - np.mean(base):.6f}" in row


@SLOW
def test_2x2_interaction_is_the_joint_delta_minus_the_sum_of_single_deltas(sweep):
    v = _by_arm(sweep["csv"], "val_loss")
    d = {arm: np.mean([v[arm][s] - v[BASE][s] for s in (1, 2)]) for arm in (IN, OUT, BOTH)}
    got = sweep["report"]["interaction"]["val_loss"]
    assert got["sum_of_singles"] == pytest.approx(d[IN] + d[OUT], abs=1e-12)
    assert got["delta_both"] == pytest.approx(d[BOTH], abs=1e-12)
    assert got["interaction"] == pytest.approx(d[BOTH] - d[IN] - d[OUT], abs=1e-12)
    contrast = [v[BOTH][s] - v[IN][s] - v[OUT][s] + v[BASE][s] for s in (1, 2)]
    assert got["test"]["p_two_sided"] == pytest.approx(sps.ttest_1samp(contrast, 0).pvalue, rel=1e-9)
    assert f"interaction (joint − sum): {d[BOTH] - d[IN] - d[OUT]:+.6f}" in sweep["report_md"]


@SLOW
def test_bands_mark_the_arms_inside_them(sweep):
    v, t = _by_arm(sweep["csv"], "val_loss"), _by_arm(sweep["csv"], "package_time_s")
    for arm in sweep["report"]["arms"][1:]:
        name = arm["name"]
        ratio = np.mean(list(t[name].values())) / np.mean(list(t[BASE].values()))
        delta = np.mean(list(v[name].values())) - np.mean(list(v[BASE].values()))
        assert arm["time_ratio"] == pytest.approx(ratio, rel=1e-12)
        assert arm["inside_bands"] == bool(delta <= 0.01 and ratio <= 1.5)


@SLOW
def test_report_only_remakes_the_same_csv_and_report(sweep, capsys):
    out = sweep["out"]
    before = {name: (out / name).read_text() for name in ("runs.csv", "report.md", "report.json")}
    for name in before:
        (out / name).unlink()
    assert ablate.main(["--report-only", "--out", str(out)]) == 0
    assert {name: (out / name).read_text() for name in before} == before


@SLOW
def test_plots_of_the_sweep(sweep, tmp_path):
    out = sweep["out"]
    log = sweep["csv"][0]["log"]
    for argv in (["curves", str(out)], ["ablation", str(out), "--metric", "bpb"], ["lambdas", log]):
        png = tmp_path / f"{argv[0]}.png"
        assert plot.main([*argv, "-o", str(png)]) == 0
        assert_png(png)


# -----------------------------------------------------------------------------
# Matched initialization, validation, dry run, reruns (no training)

def test_two_arms_of_one_seed_start_with_identical_shared_tensors():
    configs = [tg.make_config("tiny", seed=3, dtype="float32", lore_input=flag, untie_embed_after_step=0)
               for flag in (False, True)]
    params = [dict(tg.build_model(c).named_parameters()) for c in configs]
    shared = params[0].keys() & params[1].keys()
    assert shared != params[0].keys() and shared != params[1].keys()  # the arms really differ
    assert "blocks.0.attn.qkvo_w" in shared and all(torch.equal(params[0][n], params[1][n]) for n in shared)
    other_seed = dict(tg.build_model(tg.make_config("tiny", seed=4, dtype="float32",
                                                    untie_embed_after_step=0)).named_parameters())
    assert not torch.equal(other_seed["blocks.0.attn.qkvo_w"], params[0]["blocks.0.attn.qkvo_w"])


@pytest.mark.parametrize("argv, message", [
    (["--grid", "lore_inptu=false,true"], "error: --grid lore_inptu=...: unknown field 'lore_inptu' (fields are the "
                                          "trainer's flags); did you mean lore_input or lore_init?\n"),
    (["--grid", "zzz=1,2"], "error: --grid zzz=...: unknown field 'zzz' (fields are the trainer's flags); "
                            "python train_gpt_medium.py --help lists them\n"),
    (["--grid", "lore_init=none,sideways"], "error: arm lore_init=sideways: --lore_init: "),
    (["--grid", "seed=1,2"], "error: --grid seed=...: the sweep sets --seed itself"),
    (["--grid", "lore_input=true,1", "--", UNTIED], "error: arms lore_input=true and lore_input=1 are the same configuration"),
    (["--grid", "lore_input=false,true", "--baseline", "lore_input=maybe"], "error: --baseline 'lore_input=maybe' is not an arm"),
    (["--grid", "lore_input=false,true", "--", UNTIED, "--log_dir=x"], "error: extra trainer flag '--log_dir=x': the sweep sets it"),
    (["--grid", "lore_input=false,true", "--", UNTIED, "--num_iteratons=3"], "error: arm lore_input=false: unknown flag --num_iteratons"),
    (["--grid", "lore_input=false,true"], "error: arm lore_input=true: --lore_input: the record's head doubles as the input "
                                          "table until step 33, and a low-rank table cannot be both: add "
                                          "--untie_embed_after_step=0 (separate tables from the start) to use LoRE\n"),
    (["--grid", "lore_input", "--seeds", "1"], "error: --grid 'lore_input': write FIELD=VALUE1,VALUE2"),
    (["--grid", "lore_input=false,true", "--seeds", "1,x"], "error: --seeds '1,x': expected comma-separated integers"),
])
def test_an_unusable_sweep_exits_2_before_any_run(tmp_path, capsys, argv, message):
    calls = tmp_path / "calls.txt"
    code = ablate.main(["--preset", "tiny", "--out", str(tmp_path / "out"), "--launcher", launcher(tmp_path, calls),
                        *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and len(err.splitlines()) == 1, err
    assert not calls.exists() and not (tmp_path / "out").exists()


def test_dry_run_lists_every_run_in_order_and_runs_nothing(tmp_path, capsys):
    calls = tmp_path / "calls.txt"
    argv = ["--preset", "tiny", *GRID, "--seeds", "5,6", "--out", str(tmp_path / "out"), "--dry_run",
            "--launcher", launcher(tmp_path, calls), "--", UNTIED, "--num_iterations=3"]
    assert ablate.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    heads, commands = lines[0::2], lines[1::2]
    assert heads[0] == "[run 1/8] arm lore_input=false lore_output=false, seed 5" and len(heads) == 8
    assert all("--seed=5" in c for c in commands[:4]) and all("--seed=6" in c for c in commands[4:])
    assert commands[0].strip().endswith(f"--log_dir={tmp_path / 'out' / 'logs' / BASE / 'seed5'} {UNTIED} "
                                        "--num_iterations=3")
    assert not calls.exists() and not (tmp_path / "out").exists()


FAKE_TRAINER = '''import shutil, sys
from pathlib import Path
flags = dict(f[2:].split("=", 1) for f in sys.argv[1:])
with open({calls!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if flags["lore_input"] == "true" and flags["seed"] == "2":
    sys.exit(0)  # exits cleanly without writing a log
Path(flags["log_dir"]).mkdir(parents=True, exist_ok=True)
shutil.copy(Path({templates!r}) / f"seed{{flags['seed']}}.txt", Path(flags["log_dir"]) / (flags["run_id"] + "_0.txt"))
'''


def fake_sweep(tmp_path):
    """A sweep whose 'trainer' copies a hand-made finished log at once (no torch), except for
    lore_input=true seed 2, which exits 0 without a log."""
    calls, templates = tmp_path / "calls.txt", tmp_path / "templates"
    for seed in (1, 2):
        write_run_log(templates / f"seed{seed}.txt", 3.0 + seed / 100, seed=seed)
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER.format(calls=str(calls), templates=str(templates)))
    argv = ["--preset", "tiny", "--grid", "lore_input=false,true", "--seeds", "1,2", "--out", str(tmp_path / "out"),
            "--launcher", shlex.join([sys.executable, str(script)]), "--", UNTIED]
    return argv, calls


def test_exit_0_without_a_finished_log_is_a_failed_run(tmp_path, capsys):
    argv, calls = fake_sweep(tmp_path)
    assert ablate.main(argv) == 1
    rows = read_csv(tmp_path / "out" / "runs.csv")
    failed = [(r["arm"], r["seed"], r["reason"]) for r in rows if r["status"] != "finished"]
    assert failed == [("lore_input-true", "2", "exit 0 but no finished log (no log written)")]
    assert "lore_input=true, seed 2: FAILED: exit 0 but no finished log" in capsys.readouterr().out


def test_rerun_sets_an_unfinished_log_aside_and_runs_again(tmp_path):
    argv, calls = fake_sweep(tmp_path)
    ablate.main(argv)
    folder = tmp_path / "out" / "logs" / "lore_input-false" / "seed1"
    (log,) = folder.glob("*.txt")
    write_run_log(log, 3.0, finish=False)  # as if this run had been killed midway
    calls.unlink()
    ablate.main(argv)
    assert calls_made(calls) == [("lore_input-false", 1), ("lore_input-true", 2)]
    assert (folder / f"{log.name}.incomplete").exists() and ablate.read_run(log)[0] is not None


def test_progress_line_says_run_i_of_n_what_is_left_and_the_times(tmp_path, capsys):
    argv, _ = fake_sweep(tmp_path)
    ablate.main(argv)
    lines = [line for line in capsys.readouterr().out.splitlines() if ": running;" in line]
    assert lines[0] == ("[run 1/4] arm lore_input=false, seed 1: running; 3 left after this, elapsed 0:00:00, "
                        "remaining ~unknown until one run ends")
    assert lines[3].startswith("[run 4/4] arm lore_input=false, seed 2: running; 0 left after this, elapsed ")
    assert re.search(r"elapsed \d:\d\d:\d\d, remaining ~\d:\d\d:\d\d$", lines[3])


def test_a_finished_log_of_another_configuration_blocks_the_sweep(tmp_path, capsys):
    argv, calls = fake_sweep(tmp_path)
    ablate.main(argv)
    (log,) = (tmp_path / "out" / "logs" / "lore_input-false" / "seed1").glob("*.txt")
    log.write_text(log.read_text().replace("config seed = 1", "config seed = 7"))
    calls.unlink()
    assert ablate.main(argv) == 2
    assert f"{log} ran with seed = 7, this sweep asks for 1" in capsys.readouterr().err and not calls.exists()


# -----------------------------------------------------------------------------
# records/stats.py: paired_test

def test_paired_test_equals_scipy_ttest_rel():
    a, b = [3.10, 3.12, 3.09, 3.15], [3.08, 3.11, 3.05, 3.14]
    got = stats.paired_test(a, b)
    ref = sps.ttest_rel(b, a)
    d = np.subtract(b, a)
    half = sps.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert got["n"] == 4 and got["df"] == 3 and got["mean_diff"] == pytest.approx(d.mean())
    assert got["t"] == pytest.approx(ref.statistic, rel=1e-12) and got["p_two_sided"] == pytest.approx(ref.pvalue, rel=1e-12)
    assert got["ci95"] == pytest.approx([d.mean() - half, d.mean() + half], rel=1e-12)


def test_paired_test_of_one_pair_has_no_test():
    got = stats.paired_test([1.0], [1.5])
    assert got["mean_diff"] == 0.5 and np.isnan(got["t"]) and np.isnan(got["p_two_sided"])


def test_runs_of_different_trainer_scripts_are_flagged_in_the_report(tmp_path):
    argv, _ = fake_sweep(tmp_path)
    ablate.main(argv)
    report = tmp_path / "out" / "report.md"
    assert "different trainer scripts" not in report.read_text()
    (log,) = (tmp_path / "out" / "logs" / "lore_input-true" / "seed1").glob("*.txt")
    log.write_text("# an edited trainer\n" + log.read_text())
    assert ablate.main(["--report-only", "--out", str(tmp_path / "out")]) == 0
    assert "**Warning: the finished runs come from 2 different trainer scripts**" in report.read_text()
    scripts = [row["script"] for row in read_csv(tmp_path / "out" / "runs.csv") if row["status"] == "finished"]
    assert len(set(scripts)) == 2


# -----------------------------------------------------------------------------
# Path mistakes: one line, exit 2, nothing run or written

def _out_is_a_file(tmp_path):
    (tmp_path / "f.txt").write_text("keep me")
    return tmp_path / "f.txt", "is a file, not a folder"


def _out_under_a_file(tmp_path):
    (tmp_path / "f.txt").write_text("keep me")
    return tmp_path / "f.txt" / "out", "is a file, not a folder"


def _out_under_proc(tmp_path):
    return Path("/proc/no-such-dir/out"), "cannot write there: No such file or directory"


def _out_unwritable(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into any folder")
    (tmp_path / "ro").mkdir(mode=0o555)
    return tmp_path / "ro" / "out", "permission denied"


@pytest.mark.parametrize("make", [_out_is_a_file, _out_under_a_file, _out_under_proc, _out_unwritable])
def test_an_unusable_out_is_one_line_and_exit_2(tmp_path, capsys, make):
    argv, calls = fake_sweep(tmp_path)
    out, message = make(tmp_path)
    argv[argv.index("--out") + 1] = str(out)
    assert ablate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}: ") and message in err and len(err.splitlines()) == 1, err
    assert not calls.exists()
    if (tmp_path / "f.txt").exists():
        assert (tmp_path / "f.txt").read_text() == "keep me"


def test_report_only_on_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "f.txt").write_text("keep me")
    assert ablate.main(["--report-only", "--out", str(tmp_path / "f.txt")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {tmp_path / 'f.txt'}: is a file, not a sweep's output folder\n"


# -----------------------------------------------------------------------------
# Stopping the sweep stops its run

SLEEPER = '''import os, sys, time
open({pidfile!r}, "w").write(str(os.getpid()))
time.sleep(120)
'''


def _alive(pid):
    """Whether `pid` runs; a zombie waiting for its (dead) parent's reaper counts as gone, and so does
    a process reaped between the signal check and the read of its /proc entry."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _wait(predicate, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("sig, code", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 143)])
def test_stopping_ablate_stops_the_run_it_was_making(tmp_path, sig, code):
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER.format(pidfile=str(pidfile)))
    cmd = [sys.executable, str(ROOT / "records" / "ablate.py"), "--preset", "tiny", "--grid", "lore_input=false,true",
           "--seeds", "1", "--out", str(tmp_path / "out"), "--launcher", shlex.join([sys.executable, str(script)]),
           "--", UNTIED]
    sweep = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: pidfile.exists() and pidfile.read_text(), 120), sweep.stderr.read() if sweep.poll() else ""
        child = int(pidfile.read_text())
        assert _alive(child)
        sweep.send_signal(sig)
        assert sweep.wait(timeout=30) == code
        assert _wait(lambda: not _alive(child), 15), f"run {child} outlived the sweep"
    finally:
        if sweep.poll() is None:
            sweep.kill()
        if pidfile.exists() and pidfile.read_text() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    if sig == signal.SIGTERM:
        assert "interrupted: rerun the same command to continue" in sweep.stderr.read()


def test_arms_that_differ_in_many_fields_are_compared_and_their_changes_listed(tmp_path):
    """A grid value may set many fields at once (a recipe name): the report compares the arms as usual
    and lists every experiment-defining field each arm's logs change, not only the grid field."""
    out = tmp_path / "out"
    out.mkdir()
    sweep = dict(preset="tiny", grid=[["recipe", ["x01", "smear"]]], seeds=[1, 2])
    (out / "sweep.json").write_text(json.dumps(sweep))
    smear = {"recipe": "'smear'", "num_iterations": "5535", "muon_lr": "0.03", "snoo_k": "28"}
    for arm, losses, config in (("recipe-x01", [3.10, 3.12], {"recipe": "'x01'", "num_iterations": "5690",
                                                                "muon_lr": "0.025", "snoo_k": "0"}),
                                ("recipe-smear", [3.05, 3.08], smear)):
        for seed, loss in zip((1, 2), losses):
            log = write_run_log(out / "logs" / arm / f"seed{seed}" / "run.txt", loss, seed=seed)
            extra = "".join(f"\nconfig {k} = {v}" for k, v in config.items())
            log.write_text(log.read_text().replace("config seed = ", extra.lstrip("\n") + "\nconfig seed = "))
    assert ablate.main(["--report-only", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["mixed_arms"] == {}
    assert report["changes"] == {"recipe-smear": {"muon_lr": ["0.025", "0.03"], "num_iterations": ["5690", "5535"],
                                                  "recipe": ["'x01'", "'smear'"], "snoo_k": ["0", "28"]}}
    smear_arm = next(a for a in report["arms"] if a["name"] == "recipe-smear")
    assert smear_arm["vs_baseline"]["val_loss"]["paired"]["mean_diff"] == pytest.approx(-0.045)
    md = (out / "report.md").read_text()
    assert "| `recipe=smear` | `muon_lr`: 0.025 → 0.03; `num_iterations`: 5690 → 5535; `recipe`: 'x01' → 'smear'; " \
           "`snoo_k`: 0 → 28 |" in md


def test_negative_seeds_are_named_not_taken_for_a_flag(capsys):
    """`--seeds -1,2`: argparse read -1,2 as a flag ("expected one argument"); now parse_seeds answers."""
    assert ablate.main(["--preset", "tiny", "--grid", "lr=1", "--seeds", "-1,2"]) == 2
    assert "--seeds '-1,2': a seed is at least 0" in capsys.readouterr().err
