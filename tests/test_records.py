"""Tests of the record tools: records/stats.py (claim check, grouping, power, Welch comparison),
records/runlogs.py (log parsing), records/diff.py and run.sh's RUNS loop.

Expected statistics are computed here from textbook formulas, not by calling the tools' code paths.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from records import diff as diff_cli
from records import runlogs
from records import stats as stats_cli

ROOT = Path(__file__).resolve().parents[1]

# The embedded source of a real log holds the log f-strings indented; the last line is an indented
# step line that would parse (and give a wrong loss) if indentation were ignored.
SOURCE = '''import torch

def train(train_steps):
    for step in range(train_steps + 1):
        print0(f"step:{step}/{train_steps} val_loss:{val_loss:.6f} train_time:{t:.0f}ms step_avg:{t/max(step, 1):.2f}ms")
        print0(f"step:{step + 1}/{train_steps} train_time:{t:.0f}ms step_avg:{t/(step + 1):.2f}ms")
    step:10/10 val_loss:0.100000 train_time:1ms step_avg:0.10ms
'''

PASS_LOSSES = [2.9150, 2.9162, 2.9171, 2.9148, 2.9180, 2.9159]  # mean 2.9162, far below 2.92
FAIL_LOSSES = [2.9185, 2.9210, 2.9192, 2.9205]  # mean below 2.92, but p is about 0.38
TIMES = [1412.451, 1410.902, 1415.337, 1411.004, 1413.876, 1409.998]
SLOWER_TIMES = [t + 3.0 * (i % 3) for i, t in enumerate(TIMES)]


# The field groups of OUR_CONFIG's fields, as the trainer logs them (config_groups).
OUR_GROUPS = {"preset": "bookkeeping", "run_id": "bookkeeping", "seed": "bookkeeping", "log_dir": "bookkeeping",
              "num_iterations": "recipe", "muon_lr": "recipe", "device": "execution"}
EXPERIMENT_GROUPS = ["recipe", "seed ideas", "execution"]


def write_log(path, loss, time_s, *, steps=10, decimals=6, finish=True, nan_avg=False, extra="", source=SOURCE,
              config=None, groups=None):
    """A log in the trainer's format: source, versions block, step lines, peak memory.

    Without `config` it is an upstream published log; with it ({field: value}) one of ours, whose
    `config <field> = <repr>` lines follow the versions block, then, with `groups` ({field: group}),
    the config_groups and experiment_groups lines (a log written before them has none).
    """
    ms = time_s * 1000

    def avg(t, s):
        return "nan" if nan_avg else f"{t / s:.2f}"

    lines = [source.rstrip("\n"), "", "=" * 100, "Python 3.11.7", "PyTorch 2.5.1", "NVIDIA H100 80GB HBM3", "=" * 100]
    lines += [f"config {k} = {v!r}" for k, v in (config or {}).items()]
    if groups is not None:
        lines += [f"config_groups = {json.dumps(groups)}", f"experiment_groups = {json.dumps(EXPERIMENT_GROUPS)}"]
    lines.append(f"step:0/{steps} val_loss:{10.8258:.{decimals}f} train_time:0ms step_avg:nanms")
    for s in range(1, (steps if finish else steps // 2) + 1):
        t = ms * s / steps
        lines.append(f"step:{s}/{steps} train_time:{t:.0f}ms step_avg:{avg(t, s)}ms")
        if s == steps // 2:  # a mid-run val line, which must not be taken as the final one
            lines.append(f"step:{s}/{steps} val_loss:{3.5:.{decimals}f} train_time:{t:.0f}ms step_avg:{avg(t, s)}ms")
    if finish:
        lines.append(f"step:{steps}/{steps} val_loss:{loss:.{decimals}f} train_time:{ms:.0f}ms "
                     f"step_avg:{avg(ms, steps)}ms{extra}")
        lines.append("peak memory allocated: 30000 MiB reserved: 31000 MiB")
    path.write_text("\n".join(lines) + "\n")
    return path


def make_set(folder, losses, times=TIMES, **kw):
    folder.mkdir(parents=True, exist_ok=True)
    for i, (loss, t) in enumerate(zip(losses, times)):
        write_log(folder / f"run{i:02d}.txt", loss, t, **kw)
    return folder


def run_json(capsys, *argv):
    code = stats_cli.main([*map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


def textbook_describe(x):
    x = np.asarray(x, dtype=np.float64)
    return {"n": len(x), "mean": x.mean(), "std": math.sqrt(((x - x.mean()) ** 2).sum() / (len(x) - 1)),
            "median": np.median(x), "min": x.min(), "max": x.max()}


def assert_describe(got, x):
    want = textbook_describe(x)
    assert got["n"] == want["n"]
    for key in ("mean", "std", "median", "min", "max"):
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), key


# ---------------------------------------------------------------- parsing


def test_parse_log_ignores_indented_source_and_mid_run_val(tmp_path):
    parsed = runlogs.parse_log(write_log(tmp_path / "a.txt", 2.917123, 1412.451))
    assert parsed.warnings == []
    assert (parsed.result.val_loss, parsed.result.train_time_s, parsed.result.steps) == (2.917123, 1412.451, 10)


@pytest.mark.parametrize("decimals", [4, 6])
def test_parse_log_reads_4_and_6_decimal_losses(tmp_path, decimals):
    parsed = runlogs.parse_log(write_log(tmp_path / "a.txt", 2.9194, 1412.451, decimals=decimals))
    assert parsed.warnings == []
    assert parsed.result.val_loss == 2.9194


def test_parse_log_accepts_nan_step_avg(tmp_path):
    parsed = runlogs.parse_log(write_log(tmp_path / "a.txt", 2.9194, 1412.451, nan_avg=True))
    assert parsed.warnings == []
    assert (parsed.result.val_loss, parsed.result.train_time_s) == (2.9194, 1412.451)


def test_parse_log_tolerates_extra_key_value_tokens(tmp_path):
    parsed = runlogs.parse_log(write_log(tmp_path / "a.txt", 2.9194, 1412.451, extra=" val_bpb:1.234567 note:x"))
    assert parsed.warnings == []
    assert parsed.result.val_loss == 2.9194


def test_parse_log_reports_unfinished_run_with_last_step(tmp_path):
    parsed = runlogs.parse_log(write_log(tmp_path / "a.txt", 2.9194, 1412.451, finish=False))
    assert parsed.result is None
    assert "did not finish" in parsed.skip_reason and "5/10" in parsed.skip_reason


def test_parse_log_warns_on_garbled_lines_with_file_and_line(tmp_path):
    path = write_log(tmp_path / "a.txt", 2.9194, 1412.451)
    lines = path.read_text().splitlines()
    garbled = ["step:7/10 train_time:98", "step:8/10 train_time:abcms step_avg:1.00ms",
               "step:10/10 val_loss:0.1x train_time:1ms step_avg:1.00ms"]
    path.write_text("\n".join(lines + garbled) + "\n")
    parsed = runlogs.parse_log(path)
    assert len(parsed.warnings) == 3
    for i, warning in enumerate(parsed.warnings):
        assert warning.startswith(f"{path}:{len(lines) + i + 1}:")
    assert parsed.result.val_loss == 2.9194


def test_parse_log_truncated_final_val_line_is_not_used(tmp_path):
    path = write_log(tmp_path / "a.txt", 2.9194, 1412.451)
    text = path.read_text()
    path.write_text(text[: text.index("val_loss:2.919400") + len("val_loss:2.91")])
    parsed = runlogs.parse_log(path)
    assert parsed.result is None
    assert len(parsed.warnings) == 1 and "did not finish" in parsed.skip_reason


# ---------------------------------------------------------------- the claim check


def test_claim_holds_exits_0(tmp_path, capsys):
    code = stats_cli.main([str(make_set(tmp_path / "r", PASS_LOSSES))])
    assert code == 0
    assert "verdict at alpha=0.01: claim holds" in capsys.readouterr().out


def test_claim_fails_exits_1_even_with_mean_below_target(tmp_path, capsys):
    code = stats_cli.main([str(make_set(tmp_path / "r", FAIL_LOSSES))])
    assert code == 1
    assert "claim does not hold" in capsys.readouterr().out


def test_json_numbers_match_textbook_t_test(tmp_path, capsys):
    code, out = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES))
    assert code == 0
    x, n, target = np.array(PASS_LOSSES), len(PASS_LOSSES), 2.92
    sem = x.std(ddof=1) / math.sqrt(n)
    t = (x.mean() - target) / sem
    assert_describe(out["val_loss"], PASS_LOSSES)
    assert_describe(out["train_time_s"], TIMES)
    assert out["t_test"]["t"] == pytest.approx(t, rel=1e-9)
    assert out["t_test"]["p"] == pytest.approx(sps.t.cdf(t, n - 1), rel=1e-9)
    assert out["t_test"]["upper_bound_95"] == pytest.approx(x.mean() + sps.t.ppf(0.95, n - 1) * sem, rel=1e-12)
    assert out["verdict"] == "claim holds"


def test_text_output_numbers_match(tmp_path, capsys):
    stats_cli.main([str(make_set(tmp_path / "r", FAIL_LOSSES))])
    out = capsys.readouterr().out
    x = textbook_describe(FAIL_LOSSES)
    loss_line = re.search(r"^final val loss: n=(\d+) mean=(\S+) std=(\S+) median=(\S+) min=(\S+) max=(\S+)$", out, re.M)
    assert int(loss_line[1]) == 4
    for group, key in zip(loss_line.groups()[1:], ("mean", "std", "median", "min", "max")):
        assert float(group) == pytest.approx(x[key], abs=1e-6), key
    t = (x["mean"] - 2.92) / (x["std"] / 2)
    # the bound is at the level 1 - alpha (99% at the default alpha 0.01)
    test_line = re.search(r"t=(\S+) p=(\S+) 99% upper bound of mean=(\S+)$", out, re.M)
    assert float(test_line[1]) == pytest.approx(t, abs=1e-4)
    assert float(test_line[2]) == pytest.approx(sps.t.cdf(t, 3), rel=1e-3)
    assert float(test_line[3]) == pytest.approx(x["mean"] + sps.t.ppf(0.99, 3) * x["std"] / 2, abs=1e-6)
    time_line = re.search(r"^train_time \(s\): n=4 mean=(\S+) ", out, re.M)
    assert float(time_line[1]) == pytest.approx(np.mean(TIMES[:4]), abs=1e-3)


def test_target_option_changes_the_test(tmp_path, capsys):
    code, out = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES), "--target", "2.916")
    x = np.array(PASS_LOSSES)
    assert code == 1
    assert out["t_test"]["t"] == pytest.approx((x.mean() - 2.916) / (x.std(ddof=1) / math.sqrt(len(x))), rel=1e-9)


def test_alpha_option_changes_the_verdict(tmp_path, capsys):
    assert stats_cli.main([str(make_set(tmp_path / "r", FAIL_LOSSES)), "--alpha", "0.5"]) == 0


def test_unfinished_run_is_skipped_and_reported(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    write_log(folder / "zz_crashed.txt", 2.0, 100.0, finish=False)
    code = stats_cli.main([str(folder)])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"skipped .*zz_crashed\.txt: did not finish \(last step seen: 5/10\)", out)
    code, data = run_json(capsys, folder)
    assert data["skipped"][0]["path"].endswith("zz_crashed.txt")
    assert_describe(data["val_loss"], PASS_LOSSES)


def passing_set_with_a_garbled_line(tmp_path, line):
    """The passing set, with `line` appended to its first log; returns (folder, "file:line")."""
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    path = folder / "run00.txt"
    n_lines = len(path.read_text().splitlines())
    with open(path, "a") as f:
        f.write(line + "\n")
    return folder, f"{path}:{n_lines + 1}:"


def test_garbled_lines_are_listed_and_leave_numbers(tmp_path, capsys):
    # (val_loss:nan is no garble: a diverged run prints it, and it is read: the nan test below)
    folder, where = passing_set_with_a_garbled_line(tmp_path, "step:10/10 val_loss:2.9x train_time:1ms step_avg:1.00ms")
    code, data = run_json(capsys, folder)
    assert code == 0
    assert [w.split(" ")[0] for w in data["warnings"]] == [where]
    assert_describe(data["val_loss"], PASS_LOSSES)


def test_garbled_line_warning_goes_to_stderr(tmp_path, capsys):
    folder, where = passing_set_with_a_garbled_line(tmp_path, "step:10/10 val_loss:2.90 train_time:12")
    stats_cli.main([str(folder)])
    assert where in capsys.readouterr().err


def test_single_run_says_no_test_and_exits_1(tmp_path, capsys):
    path = write_log(tmp_path / "a.txt", 2.9, 1412.0)
    assert stats_cli.main([str(path)]) == 1
    assert "not possible" in capsys.readouterr().out
    code, data = run_json(capsys, path)
    assert (code, data["val_loss"]["std"], data["t_test"]["p"]) == (1, None, None)


def test_empty_folder_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    assert stats_cli.main([str(tmp_path / "empty")]) == 2


def test_nonexistent_path_exits_2(tmp_path):
    assert stats_cli.main([str(tmp_path / "nope")]) == 2


def test_no_finished_runs_exits_2(tmp_path):
    folder = make_set(tmp_path / "r", PASS_LOSSES[:2], finish=False)
    assert stats_cli.main([str(folder)]) == 2


def test_script_entry_point_returns_exit_status(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "records" / "stats.py"), str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "nope" in proc.stderr


def test_default_path_is_newest_record_folder(tmp_path, capsys):
    make_set(tmp_path / "2024-12-31_Old", FAIL_LOSSES)
    make_set(tmp_path / "2025-01-02_Alpha", FAIL_LOSSES)
    newest = make_set(tmp_path / "2025-01-02_Beta", PASS_LOSSES)  # same date: ties broken by name
    make_set(tmp_path / "zz_not_a_record", FAIL_LOSSES)
    code, data = run_json(capsys, "--records-dir", tmp_path)
    assert code == 0
    assert data["paths"] == [str(newest)]


# ---------------------------------------------------------------- comparing two sets


def welch_by_formula(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    diff, se = b.mean() - a.mean(), math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = sps.t.ppf(0.975, df) * se
    return {"mean_a": a.mean(), "mean_b": b.mean(), "diff": diff, "lo": diff - half, "hi": diff + half,
            "df": df, "t": diff / se, "p": 2 * sps.t.sf(abs(diff / se), df)}


@pytest.mark.parametrize("key, a_values, b_values", [
    ("val_loss", FAIL_LOSSES, PASS_LOSSES),
    ("train_time_s", TIMES[:4], SLOWER_TIMES),
])
def test_compare_matches_welch_formula(tmp_path, capsys, key, a_values, b_values):
    a = make_set(tmp_path / "a", FAIL_LOSSES, TIMES)
    b = make_set(tmp_path / "b", PASS_LOSSES, SLOWER_TIMES)
    code, data = run_json(capsys, "--compare", a, b)
    assert code == 0 and data["difference"] == "B - A"
    got, want = data[key], welch_by_formula(a_values, b_values)
    assert got["mean_a"] == pytest.approx(want["mean_a"], rel=1e-12)
    assert got["mean_b"] == pytest.approx(want["mean_b"], rel=1e-12)
    assert got["diff_b_minus_a"] == pytest.approx(want["diff"], rel=1e-9)
    assert got["ci95"] == pytest.approx([want["lo"], want["hi"]], rel=1e-9)
    assert got["df"] == pytest.approx(want["df"], rel=1e-9)
    assert got["t"] == pytest.approx(want["t"], rel=1e-9)
    assert got["p_two_sided"] == pytest.approx(want["p"], rel=1e-9)


def test_compare_text_names_the_direction(tmp_path, capsys):
    a = make_set(tmp_path / "a", FAIL_LOSSES)
    b = make_set(tmp_path / "b", PASS_LOSSES)
    assert stats_cli.main(["--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    want = welch_by_formula(FAIL_LOSSES, PASS_LOSSES)
    line = re.search(r"^final val loss: .* B - A=(\S+) 95% CI \[(\S+), (\S+)\].* p \(two-sided\)=(\S+)$", out, re.M)
    expected = [want["diff"], want["lo"], want["hi"], want["p"]]
    assert [float(v) for v in line.groups()] == pytest.approx(expected, rel=1e-3)


def test_compare_needs_two_finished_runs_per_set(tmp_path):
    a = make_set(tmp_path / "a", FAIL_LOSSES[:1])
    b = make_set(tmp_path / "b", PASS_LOSSES)
    assert stats_cli.main(["--compare", str(a), str(b)]) == 2


def test_compare_missing_path_exits_2(tmp_path):
    b = make_set(tmp_path / "b", PASS_LOSSES)
    assert stats_cli.main(["--compare", str(tmp_path / "nope"), str(b)]) == 2


# ---------------------------------------------------------------- diff.py


def make_record(root, name, script=None, log_source=None):
    folder = root / name
    folder.mkdir(parents=True)
    if script is not None:
        (folder / "train_gpt_medium.py").write_text(script)
    if log_source is not None:
        write_log(folder / "a_run.txt", 2.919, 1412.0, source=log_source)
        write_log(folder / "b_run.txt", 2.919, 1412.0, source="other = 'not the first log'\n")
    return folder


def test_diff_uses_predecessor_by_date_order(tmp_path, capsys):
    newest = make_record(tmp_path, "2025-03-01_C", script="lr = 0.3\nsteps = 5690\n")
    make_record(tmp_path, "2025-01-01_A", script="lr = 0.1\nsteps = 5690\n")
    make_record(tmp_path, "2025-02-01_B", script="lr = 0.2\nsteps = 5690\n")
    (tmp_path / "zz_notes").mkdir()
    assert diff_cli.main([str(newest)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["--- 2025-02-01_B/train_gpt_medium.py", "+++ 2025-03-01_C/train_gpt_medium.py"]
    assert "-lr = 0.2" in out and "+lr = 0.3" in out and " steps = 5690" in out


def test_diff_extracts_script_from_first_log(tmp_path, capsys):
    make_record(tmp_path, "2025-01-01_A", log_source="lr = 0.1\nsteps = 5690\n")
    new = make_record(tmp_path, "2025-02-01_B", script="lr = 0.2\nsteps = 5690\n")
    assert diff_cli.main([str(new)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "--- 2025-01-01_A/a_run.txt (embedded source)"
    # only the script changed: no versions block, step lines or separator leak in from the log
    assert [line for line in out[2:] if line[:1] in "+-"] == ["-lr = 0.1", "+lr = 0.2"]


def test_diff_against_other_py_file(tmp_path, capsys):
    new = make_record(tmp_path, "2025-02-01_B", script="lr = 0.2\n")
    other = tmp_path / "baseline.py"
    other.write_text("lr = 0.5\n")
    assert diff_cli.main([str(new), str(other)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"--- {other}" and "-lr = 0.5" in out and "+lr = 0.2" in out


def test_diff_without_predecessor_exits_2_naming_folder(tmp_path, capsys):
    only = make_record(tmp_path, "2025-01-01_A", script="lr = 0.1\n")
    assert diff_cli.main([str(only)]) == 2
    err = capsys.readouterr().err
    assert "2025-01-01_A" in err and "no predecessor" in err


def test_diff_folder_without_script_or_log_exits_2(tmp_path, capsys):
    make_record(tmp_path, "2025-01-01_A")
    new = make_record(tmp_path, "2025-02-01_B", script="lr = 0.2\n")
    assert diff_cli.main([str(new)]) == 2
    assert "2025-01-01_A" in capsys.readouterr().err


# ---------------------------------------------------------------- experiments: grouping before testing

# A few of the trainer's config lines; the real logs carry one per Hyperparameters field.
OUR_CONFIG = {"preset": "medium", "run_id": "", "seed": 0, "log_dir": "logs", "num_iterations": 10, "muon_lr": 0.025}


def make_our_set(folder, losses, times=TIMES, first_seed=100, groups=OUR_GROUPS, **config):
    """A folder of logs in our format: config lines (and, unless groups=None, the field groups), a
    different seed (and log_dir) per run."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (loss, t) in enumerate(zip(losses, times)):
        cfg = {**OUR_CONFIG, "seed": first_seed + i, "log_dir": f"logs/machine{i}", **config}
        write_log(folder / f"ours{first_seed + i}.txt", loss, t, config=cfg, groups=groups)
    return folder


def t_test_by_scipy(x, target=2.92, alpha=0.01):
    x = np.asarray(x, dtype=np.float64)
    sem = x.std(ddof=1) / math.sqrt(len(x))
    res = sps.ttest_1samp(x, target, alternative="less")
    return {"t": res.statistic, "p": res.pvalue, "bound": x.mean() + sps.t.ppf(1 - alpha, len(x) - 1) * sem}


def test_two_step_counts_in_one_folder_are_two_groups_and_refused(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    for i, loss in enumerate(FAIL_LOSSES[:3]):
        write_log(folder / f"zz_long{i}.txt", loss, 1500.0 + i, steps=12)
    code = stats_cli.main([str(folder)])
    captured = capsys.readouterr()
    assert code == 2
    assert "split the folder" in captured.err and "--pool" in captured.err
    assert re.search(r"^group A: 6 run\(s\), .*10 steps", captured.out, re.M)
    assert re.search(r"^group B: 3 run\(s\), .*12 steps", captured.out, re.M)
    code, data = run_json(capsys, folder)
    assert code == 2 and data["verdict"] == "refused" and data["t_test"] is None
    assert [len(g["runs"]) for g in data["groups"]] == [6, 3]
    assert data["groups"][1]["distinct"] == {"steps": "12"}


def test_each_group_of_a_refused_folder_is_tested_on_its_own(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    for i, loss in enumerate(FAIL_LOSSES):
        write_log(folder / f"zz_long{i}.txt", loss, 1500.0 + i, steps=12)
    _, data = run_json(capsys, folder)
    for group, losses in zip(data["groups"], (PASS_LOSSES, FAIL_LOSSES)):
        want = t_test_by_scipy(losses)
        assert group["analysis"]["t_test"]["p"] == pytest.approx(want["p"], rel=1e-9)


def test_different_scripts_are_two_groups(tmp_path, capsys):
    folder = make_our_set(tmp_path / "r", PASS_LOSSES[:3])
    for i, loss in enumerate(PASS_LOSSES[3:]):
        write_log(folder / f"z{i}.txt", loss, 1400.0, source=SOURCE + "# the record's change\n",
                  config={**OUR_CONFIG, "seed": 7 + i}, groups=OUR_GROUPS)
    code, data = run_json(capsys, folder)
    assert code == 2
    assert [len(g["runs"]) for g in data["groups"]] == [3, 3]
    assert set(data["groups"][0]["distinct"]) == {"script"}


def test_runs_differing_only_in_seed_and_log_dir_are_one_experiment(tmp_path, capsys):
    code, data = run_json(capsys, make_our_set(tmp_path / "r", PASS_LOSSES))
    assert code == 0 and len(data["groups"]) == 1 and data["refused"] is None
    assert data["t_test"]["p"] == pytest.approx(t_test_by_scipy(PASS_LOSSES)["p"], rel=1e-9)


def test_a_changed_flag_is_a_different_experiment(tmp_path, capsys):
    folder = make_our_set(tmp_path / "r", PASS_LOSSES[:3])
    make_our_set(folder, PASS_LOSSES[3:], first_seed=200, muon_lr=0.03)
    code, data = run_json(capsys, folder)
    assert code == 2
    assert [g["distinct"] for g in data["groups"]] == [{"muon_lr": "0.025"}, {"muon_lr": "0.03"}]


def test_pool_tests_all_groups_as_one_claim(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    write_log(folder / "long.txt", 2.9140, 1500.0, steps=12)
    code, data = run_json(capsys, folder, "--pool")
    losses = PASS_LOSSES + [2.9140]
    assert code == 0 and data["pooled"] and data["refused"] is None
    assert_describe(data["val_loss"], losses)
    assert data["t_test"]["p"] == pytest.approx(t_test_by_scipy(losses)["p"], rel=1e-9)
    assert any("--pool" in w for w in data["warnings"])


def test_byte_identical_copy_is_counted_once_with_a_warning_naming_both(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    (folder / "zz_copy.txt").write_bytes((folder / "run00.txt").read_bytes())
    code, data = run_json(capsys, folder)
    assert code == 0
    assert_describe(data["val_loss"], PASS_LOSSES)
    assert data["t_test"]["p"] == pytest.approx(t_test_by_scipy(PASS_LOSSES)["p"], rel=1e-9)
    [warning] = data["duplicates"]
    assert str(folder / "run00.txt") in warning and str(folder / "zz_copy.txt") in warning


def test_4_decimal_losses_warn(tmp_path, capsys):
    stats_cli.main([str(make_set(tmp_path / "r", [2.9150, 2.9162, 2.9171], decimals=4))])
    assert "only 4 decimals" in capsys.readouterr().err


def test_6_decimal_losses_do_not_warn(tmp_path, capsys):
    stats_cli.main([str(make_set(tmp_path / "r", PASS_LOSSES))])
    assert capsys.readouterr().err == ""


def test_mixing_4_and_6_decimal_losses_in_one_group_warns(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    write_log(folder / "short.txt", 2.9160, 1411.0, decimals=4)
    stats_cli.main([str(folder)])
    assert "mixes 1 coarse-decimal" in capsys.readouterr().err


def test_runs_sharing_a_seed_warn(tmp_path, capsys):
    folder = make_our_set(tmp_path / "r", PASS_LOSSES[:3])
    write_log(folder / "again.txt", PASS_LOSSES[3], 1411.0, config={**OUR_CONFIG, "seed": 101}, groups=OUR_GROUPS)
    stats_cli.main([str(folder)])
    assert re.search(r"runs .*/again\.txt, .*/ours101\.txt share seed 101", capsys.readouterr().err)


# ---------------------------------------------------------------- the claim's further figures


@pytest.mark.parametrize("alpha, label", [(0.01, "99%"), (0.05, "95%"), (0.1, "90%")])
def test_upper_bound_follows_alpha(tmp_path, capsys, alpha, label):
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    _, data = run_json(capsys, folder, "--alpha", alpha)
    assert data["t_test"]["upper_bound"] == pytest.approx(t_test_by_scipy(PASS_LOSSES, alpha=alpha)["bound"], rel=1e-12)
    assert data["t_test"]["upper_bound_level"] == pytest.approx(1 - alpha)
    stats_cli.main([str(folder), "--alpha", str(alpha)])
    bound = re.search(rf" {label} upper bound of mean=(\S+)$", capsys.readouterr().out, re.M)
    assert float(bound[1]) == pytest.approx(t_test_by_scipy(PASS_LOSSES, alpha=alpha)["bound"], abs=1e-6)


def nct_power(losses, n, target=2.92, alpha=0.01):
    """P(p < alpha) for n runs of the one-sided one-sample t-test if the truth is the observed mean and std."""
    x = np.asarray(losses)
    effect = (target - x.mean()) / x.std(ddof=1)
    return sps.nct.sf(sps.t.ppf(1 - alpha, n - 1), n - 1, effect * math.sqrt(n))


@pytest.mark.parametrize("losses", [PASS_LOSSES, FAIL_LOSSES])
def test_runs_needed_is_the_first_n_with_enough_noncentral_t_power(tmp_path, capsys, losses):
    _, data = run_json(capsys, make_set(tmp_path / "r", losses))
    power = data["power"]
    assert "noncentral-t" in power["method"]
    assert power["power_at_n"] == pytest.approx(nct_power(losses, len(losses)), rel=1e-9)
    for level in (80, 90):
        first = next(n for n in range(2, 10_000) if nct_power(losses, n) >= level / 100)
        assert power[f"runs_needed_{level}"] == first


def test_power_of_a_mean_above_target_says_no_number_of_runs_will_do(tmp_path, capsys):
    code = stats_cli.main([str(make_set(tmp_path / "r", [2.9210, 2.9230, 2.9190]))])
    assert code == 1
    assert "no number of runs will give p < alpha" in capsys.readouterr().out


def test_chance_of_one_run_below_target_is_the_normal_cdf(tmp_path, capsys):
    _, data = run_json(capsys, make_set(tmp_path / "r", FAIL_LOSSES))
    x = np.asarray(FAIL_LOSSES)
    assert data["single_run_below"]["p"] == pytest.approx(sps.norm.cdf(2.92, x.mean(), x.std(ddof=1)), rel=1e-12)
    assert "normal model" in data["single_run_below"]["method"]


@pytest.mark.parametrize("seconds, code", [(1420, 0), (1414, 1)])  # p = 1.2e-4 and 0.045
def test_time_vs_seconds_is_a_one_sided_one_sample_t_test(tmp_path, capsys, seconds, code):
    got, data = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES), "--time-vs", seconds)
    tv, x = data["time_vs"], np.asarray(TIMES)
    assert tv["p"] == pytest.approx(sps.ttest_1samp(x, seconds, alternative="less").pvalue, rel=1e-9)
    assert tv["upper_bound"] == pytest.approx(x.mean() + sps.t.ppf(0.99, 5) * x.std(ddof=1) / math.sqrt(6), rel=1e-12)
    assert got == code and tv["holds"] == (code == 0)


@pytest.mark.parametrize("slower_by, code", [(9.0, 0), (4.0, 1)])  # p = 0.0054 and 0.031
def test_time_vs_path_is_a_one_sided_welch_test(tmp_path, capsys, slower_by, code):
    previous = make_set(tmp_path / "prev", FAIL_LOSSES, [t + slower_by for t in SLOWER_TIMES])
    got, data = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES), "--time-vs", previous)
    new, old = np.asarray(TIMES), np.asarray([t + slower_by for t in SLOWER_TIMES[:4]])
    tv = data["time_vs"]
    assert tv["p"] == pytest.approx(sps.ttest_ind(new, old, equal_var=False, alternative="less").pvalue, rel=1e-9)
    w = welch_by_formula(old, new)
    se = w["diff"] / w["t"]
    assert tv["upper_bound"] == pytest.approx(w["diff"] + sps.t.ppf(0.99, w["df"]) * se, rel=1e-9)
    assert got == code


def test_time_vs_a_slower_claim_fails_even_when_the_loss_passes(tmp_path, capsys):
    code = stats_cli.main([str(make_set(tmp_path / "r", PASS_LOSSES)), "--time-vs", "1400"])
    out = capsys.readouterr().out
    assert code == 1
    assert "time verdict: not shown to be faster" in out and "claim does not hold" in out


# ---------------------------------------------------------------- runs that get no verdict

TINY_LOSSES = [2.786445, 2.791768, 2.777792]  # `./run.sh --preset tiny --recipe bulk` on a CPU: far below 2.92
TINY_TIMES = [53.087, 87.685, 81.331]


def make_tiny_set(folder, preset="tiny", device="cpu", losses=TINY_LOSSES, times=TINY_TIMES, **config):
    """Logs in our format of tiny CPU runs: preset, synthetic data and the trainer's device line."""
    make_our_set(folder, losses, times, preset=preset, synthetic_data=preset == "tiny", **config)
    for log in folder.glob("*.txt"):
        log.write_text(log.read_text().replace("step:0/", f"world_size 1, micro-steps per rank 2, device {device}\n"
                                               "step:0/", 1))
    return folder


@pytest.mark.parametrize("argv", [[], ["--time-vs", "100"], ["--target", "2.8"], ["--target", "2.8", "--alpha", "0.5"]])
def test_tiny_cpu_runs_get_no_verdict_and_exit_3(tmp_path, capsys, argv):
    folder = make_tiny_set(tmp_path / "tiny")
    code, data = run_json(capsys, folder, *argv)
    assert code == 3 and data["verdict"] == "no verdict"
    assert "3 of 3 run(s) ran on the CPU, used the tiny preset, trained on synthetic data" in data["no_verdict"]
    assert data["val_loss"]["n"] == 3 and data["train_time_s"]["n"] == 3  # the figures are kept
    assert stats_cli.main([str(folder), *argv]) == 3
    out = capsys.readouterr().out
    assert "claim holds" not in out and "time verdict" not in out
    assert out.splitlines()[-1].startswith("verdict at alpha=")
    assert out.splitlines()[-1].endswith(": no verdict: " + data["no_verdict"])


def test_runs_on_the_cpu_get_no_verdict_whatever_the_preset(tmp_path, capsys):
    code, data = run_json(capsys, make_tiny_set(tmp_path / "r", preset="medium", losses=PASS_LOSSES[:3]))
    assert code == 3 and data["no_verdict"].startswith("3 of 3 run(s) ran on the CPU (not medium-track runs)")


def test_runs_far_below_the_medium_target_get_no_verdict(tmp_path, capsys):
    code, data = run_json(capsys, make_set(tmp_path / "r", TINY_LOSSES))  # upstream-format logs: no device line
    assert code == 3 and "far below the 2.92 target" in data["no_verdict"]
    code, data = run_json(capsys, "--values", ",".join(map(str, TINY_LOSSES)))
    assert code == 3 and data["verdict"] == "no verdict"


def test_time_vs_reference_runs_that_are_not_medium_track_runs_give_no_verdict(tmp_path, capsys):
    reference = make_tiny_set(tmp_path / "tiny", times=[1500.0, 1510.0, 1505.0])
    code, data = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES), "--time-vs", reference)
    assert code == 3 and data["no_verdict"].startswith(f"the --time-vs reference {reference}: 3 of 3 run(s)")
    assert data["time_vs"]["p"] is not None  # the test is still reported, without a verdict


def test_table_says_no_verdict_for_tiny_runs(tmp_path, capsys):
    tiny, good = make_tiny_set(tmp_path / "tiny"), make_set(tmp_path / "good", PASS_LOSSES)
    assert stats_cli.main([str(tiny), str(good), "--table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith(str(tiny)) and lines[2].endswith("no verdict")
    assert lines[3].startswith(str(good)) and lines[3].endswith("holds")


def test_single_run_prints_its_figures(tmp_path, capsys):
    code = stats_cli.main([str(make_set(tmp_path / "r", [2.9123]))])
    out = capsys.readouterr().out
    assert code == 1
    assert "final val loss: n=1 mean=2.912300" in out and "at least 2 runs" in out


SMALL_TRACK_LOSSES = [3.2791, 3.2802, 3.2785]  # 124M-track runs, target 3.28


@pytest.mark.parametrize("losses, target, code, expected", [
    (SMALL_TRACK_LOSSES, 2.92, 1, "far above the target 2.92; did you mean --target=3.28"),
    (SMALL_TRACK_LOSSES, 3.6, 0, "far below the target 3.6; did you mean --target=3.28"),
    ([3.5012, 3.5023, 3.5007], 2.92, 1, "did you mean another --target?"),
])
def test_runs_far_from_target_give_a_hint(tmp_path, capsys, losses, target, code, expected):
    got, data = run_json(capsys, make_set(tmp_path / "r", losses), "--target", target)
    assert got == code
    assert expected in data["hint"]


def test_tiny_runs_far_from_the_target_are_not_sent_to_another_target(tmp_path, capsys):
    code, data = run_json(capsys, make_tiny_set(tmp_path / "tiny"))
    assert code == 3
    assert data["hint"] == ("every run is far below the target 2.92, and they are not medium-track runs (the verdict "
                            "says why): no --target makes them a record claim")


def test_close_to_target_gives_no_hint(tmp_path, capsys):
    _, data = run_json(capsys, make_set(tmp_path / "r", FAIL_LOSSES))
    assert data["hint"] is None


# ---------------------------------------------------------------- --values and --table

FIGURES = ("val_loss", "t_test", "power", "single_run_below", "verdict")


def test_values_list_gives_the_same_result_as_logs(tmp_path, capsys):
    _, from_logs = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES))
    code, from_values = run_json(capsys, "--values", ",".join(f"{x:.6f}" for x in PASS_LOSSES))
    assert code == 0
    for key in FIGURES:
        assert from_values[key] == from_logs[key], key


def test_values_file_with_times_gives_the_same_result_as_logs(tmp_path, capsys):
    values = tmp_path / "values.txt"
    values.write_text("# loss time_s, from a README\n\n" +
                      "".join(f"{x:.6f} {t}\n" for x, t in zip(FAIL_LOSSES, TIMES)))
    _, from_logs = run_json(capsys, make_set(tmp_path / "r", FAIL_LOSSES), "--time-vs", "1420")
    code, from_values = run_json(capsys, "--values", values, "--time-vs", "1420")
    assert code == 1
    for key in FIGURES + ("train_time_s", "time_vs"):
        assert from_values[key] == from_logs[key], key


def test_values_bad_entry_exits_2_naming_the_line(tmp_path, capsys):
    values = tmp_path / "values.txt"
    values.write_text("2.9150\n2.91x\n")
    assert stats_cli.main(["--values", str(values)]) == 2
    assert f"{values}:2:" in capsys.readouterr().err


def test_values_and_paths_together_exit_2(tmp_path):
    assert stats_cli.main([str(make_set(tmp_path / "r", PASS_LOSSES)), "--values", "2.91,2.92"]) == 2


def test_table_has_one_row_per_folder_and_group(tmp_path, capsys):
    good = make_set(tmp_path / "2025-01-18", PASS_LOSSES)
    mixed = make_set(tmp_path / "2025-11-02-Smear-MTP", FAIL_LOSSES)
    for i, loss in enumerate(PASS_LOSSES[:2]):
        write_log(mixed / f"zz_long{i}.txt", loss, 1500.0 + i, steps=12)
    code, data = run_json(capsys, good, mixed, "--table")
    assert code == 0
    rows = [(r["path"], r["group"], r["val_loss"]["n"]) for r in data["rows"]]
    assert rows == [(str(good), None, 6), (str(mixed), "A", 4), (str(mixed), "B", 2)]
    for row, losses in zip(data["rows"], (PASS_LOSSES, FAIL_LOSSES, PASS_LOSSES[:2])):
        assert row["t_test"]["p"] == pytest.approx(t_test_by_scipy(losses)["p"], rel=1e-9)
    stats_cli.main([str(good), str(mixed), "--table"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["set", "n", "mean"]
    assert lines[2].split()[0] == str(good) and lines[2].split()[-1] == "holds"
    assert lines[3].startswith(f"{mixed} [A]") and lines[3].endswith("does not hold")


def test_table_reports_an_unusable_folder_in_its_row(tmp_path, capsys):
    good = make_set(tmp_path / "good", PASS_LOSSES)
    (tmp_path / "2025-01-18").mkdir()
    code = stats_cli.main([str(good), str(tmp_path / "nope"), str(tmp_path / "2025-01-18"), "--table"])
    assert code == 0
    out = capsys.readouterr().out
    assert re.search(r"nope .*error: no such file or folder", out)
    assert re.search(r"2025-01-18 .*error: no \*\.txt logs", out)


def test_table_leaves_out_folders_that_are_neither_records_nor_hold_logs(tmp_path, capsys):
    good = make_set(tmp_path / "2025-01-18", PASS_LOSSES)
    (tmp_path / "__pycache__").mkdir()
    code, data = run_json(capsys, good, tmp_path / "__pycache__", "--table")
    assert code == 0 and [r["path"] for r in data["rows"]] == [str(good)]


# ---------------------------------------------------------------- record folder names


@pytest.mark.parametrize("name, expected", [
    ("2025-01-18", ("2025-01-18", "")),
    ("2025-01-18_Muon", ("2025-01-18", "Muon")),
    ("2025-11-02-Smear-MTP", ("2025-11-02", "Smear-MTP")),
    ("2025-13-02_BadMonth", None),
    ("notes", None),
    ("2025-01-18Name", None),
])
def test_record_name_forms(name, expected):
    assert runlogs.record_name(name) == expected


def test_default_path_recognises_every_name_form(tmp_path, capsys):
    make_set(tmp_path / "2025-01-18", FAIL_LOSSES)
    newest = make_set(tmp_path / "2025-11-02-Smear-MTP", PASS_LOSSES)
    make_set(tmp_path / "2025-06-01_Middle", FAIL_LOSSES)
    _, data = run_json(capsys, "--records-dir", tmp_path)
    assert data["paths"] == [str(newest)]


# ---------------------------------------------------------------- diff.py: name forms, --nearest, --stat, configs


@pytest.mark.parametrize("record, expected", [
    ("2025-11-02-Smear-MTP", "2025-06-01_Middle"),
    ("2025-06-01_Middle", "2025-01-18"),
    ("2025-01-18", None),
])
def test_diff_predecessor_across_name_forms(tmp_path, record, expected):
    for name in ("2025-01-18", "2025-06-01_Middle", "2025-11-02-Smear-MTP"):
        make_record(tmp_path, name, script=f"# {name}\n")
    if expected is None:
        with pytest.raises(diff_cli.DiffError, match="no predecessor"):
            diff_cli.predecessor(tmp_path / record)
    else:
        assert diff_cli.predecessor(tmp_path / record) == tmp_path / expected


BASE_SCRIPT = "".join(f"line_{i} = {i}\n" for i in range(20))


def test_diff_nearest_picks_the_earlier_record_with_the_fewest_changed_lines(tmp_path, capsys):
    make_record(tmp_path, "2025-01-01_Close", script=BASE_SCRIPT.replace("line_3 = 3", "line_3 = 33"))
    make_record(tmp_path, "2025-02-01_Far", script=BASE_SCRIPT.replace("= 1", "= 100").replace("= 2", "= 200"))
    new = make_record(tmp_path, "2025-03-01_New", script=BASE_SCRIPT)
    assert diff_cli.main([str(new), "--nearest"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "--- 2025-01-01_Close/train_gpt_medium.py"
    assert "nearest earlier record: 2025-01-01_Close (2 changed line(s))" in captured.err
    assert diff_cli.main([str(new)]) == 0  # without --nearest: the previous by date
    assert capsys.readouterr().out.splitlines()[0] == "--- 2025-02-01_Far/train_gpt_medium.py"


def test_diff_stat_counts_added_and_removed_lines_per_section(tmp_path, capsys):
    rule = "# " + "-" * 77 + "\n"
    old = rule + "# Model\nwidth = 1\ndepth = 2\n" + rule + "# Training loop\nlr = 0.1\n"
    new = rule + "# Model\nwidth = 2\ndepth = 2\nheads = 4\n" + rule + "# Training loop\nlr = 0.1\n"
    make_record(tmp_path, "2025-01-01", script=old)
    record = make_record(tmp_path, "2025-02-01", script=new)
    assert diff_cli.main([str(record), "--stat"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2025-01-01/train_gpt_medium.py -> 2025-02-01/train_gpt_medium.py: 2 line(s) added, 1 removed"
    assert lines[1].split() == ["+2", "-1", "Model"]


TRAINER_LIKE = """import torch

# =============================================================================
# 1. Hyperparameters: the defaults ARE the record recipe

@dataclass
class Hyperparameters:
    muon_lr: float = 0.025

# =============================================================================
# 4. Model

# ---- --attention=fa3: FlashAttention-3's kernel (a sub-banner whose comment never ends)

FA3_KERNEL = "varunneal/flash-attention-3"


def flash_attention_3():
    return FA3_KERNEL


# The MLP of every block.
class MLP(nn.Module):
    def forward(self, x):
        return relu(x).square()
"""


def test_diff_stat_finds_the_section_and_the_class_or_def_of_each_change(tmp_path, capsys):
    """Issue 24.9: Hyperparameters counted under "(top of file)", MLP under the fa3 sub-banner."""
    new = (TRAINER_LIKE.replace("0.025", "0.03").replace("relu(x).square()", "gelu(x)")
           .replace("The MLP of", "The MLP in").replace("flash-attention-3", "flash-attention-4"))
    make_record(tmp_path, "2025-01-01", script=TRAINER_LIKE)
    record = make_record(tmp_path, "2025-02-01", script=new)
    assert diff_cli.main([str(record), "--stat"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(None, 2) for line in lines[1:7]] == [
        ["+1", "-1", "1. Hyperparameters"], ["+1", "-1", "class Hyperparameters"],
        ["+3", "-3", "4. Model"], ["+1", "-1", "--attention=fa3"], ["+2", "-2", "class MLP"],
        ["config", "not", "compared: 2025-01-01 has no log; 2025-02-01 has no log"]]
    assert lines[2].startswith("      ")  # a class/def line is indented under its section


def test_diff_sections_of_the_trainer_follow_its_banners_and_classes():
    """The real script: a Hyperparameters field lies in class Hyperparameters of the Hyperparameters
    section, the MLP class in the model section (not under the fa3 sub-banner above it)."""
    lines = (ROOT / "train_gpt_medium.py").read_text().splitlines()
    sections = diff_cli.line_sections(lines)

    def where(prefix):
        return sections[next(i for i, line in enumerate(lines) if line.startswith(prefix))]
    section, place = where("    muon_lr: float")
    assert "Hyperparameters" in section and place == "class Hyperparameters"
    section, place = where("class MLP(")
    assert "Model" in section and place == "class MLP"
    assert where("def main(")[1] == "def main"


def test_diff_names_the_recipe_of_each_side(tmp_path, capsys):
    """Issue 24.9: recipe is a bookkeeping field, so the comparison of experiment fields left it out."""
    groups = {**OUR_GROUPS, "recipe": "bookkeeping"}
    make_our_set(tmp_path / "2025-01-01_X01", PASS_LOSSES[:1], groups=groups, recipe="x01")
    record = make_our_set(tmp_path / "2025-02-01_Bulk", PASS_LOSSES[:1], groups=groups, recipe="bulk", muon_lr=0.015)
    assert diff_cli.main([str(record)]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(i for i, line in enumerate(out) if line.startswith("config 2025-01-01_X01/"))
    assert out[i + 1:] == ["  recipe: x01 -> bulk", "  muon_lr: 0.025 -> 0.015"]
    same = make_our_set(tmp_path / "2025-03-01_Bulk", PASS_LOSSES[:1], groups=groups, recipe="bulk", muon_lr=0.015,
                        preset="tiny")
    assert diff_cli.main([str(same)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3].endswith(": no difference") and out[-2:] == ["  recipe: bulk (both)", "  preset: medium -> tiny"]


def test_diff_shows_the_config_flag_that_changed(tmp_path, capsys):
    make_our_set(tmp_path / "2025-01-01_Base", PASS_LOSSES[:2])
    record = make_our_set(tmp_path / "2025-02-01_HigherLR", PASS_LOSSES[:2], first_seed=900, muon_lr=0.03)
    assert diff_cli.main([str(record)]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(i for i, line in enumerate(out) if line.startswith("config 2025-01-01_Base/"))
    assert out[i + 1:] == ["  muon_lr: 0.025 -> 0.03"]  # the seed and log_dir differ too, but are not compared


def test_diff_says_why_configs_are_not_compared_for_upstream_logs(tmp_path, capsys):
    make_record(tmp_path, "2025-01-01_A", log_source="lr = 0.1\n")
    new = make_record(tmp_path, "2025-02-01_B", log_source="lr = 0.2\n")
    assert diff_cli.main([str(new)]) == 0
    assert "config not compared: 2025-01-01_A/a_run.txt has no config lines" in capsys.readouterr().out


def test_diff_warns_when_a_folder_holds_more_than_one_script(tmp_path, capsys):
    make_record(tmp_path, "2025-01-01_A", script="lr = 0.1\n")
    new = make_record(tmp_path, "2025-02-01_B", log_source="lr = 0.2\n")  # b_run.txt holds another script
    assert diff_cli.main([str(new)]) == 0
    err = capsys.readouterr().err
    assert "2025-02-01_B holds 2 distinct scripts (a_run.txt; b_run.txt)" in err
    assert "compared: 2025-02-01_B/a_run.txt (embedded source)" in err


# ---------------------------------------------------------------- run.sh RUNS


def fake_python(tmp_path, fail_at=0, code=7):
    """An executable standing in for $PYTHON: appends its arguments to calls.txt; call `fail_at` exits `code`."""
    calls = tmp_path / "calls.txt"
    script = tmp_path / "fake_python"
    script.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n'
                      f'[ "$(wc -l < {calls})" -eq {fail_at} ] && exit {code}\nexit 0\n')
    script.chmod(0o755)
    return script, calls


def run_sh(tmp_path, python, args, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("RUNS", "NPROC_PER_NODE", "NNODES")}
    environ.update(PYTHON=str(python), CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run([str(ROOT / "run.sh"), *args], capture_output=True, text=True, env=environ, timeout=60)


def trainer_calls(calls):
    """The launcher's trainer calls among the fake Python's calls (run.sh also runs records/summary.py)."""
    return [line for line in calls.read_text().splitlines() if line.startswith("train_gpt_medium.py")]


def test_run_sh_runs_repeats_the_trainer_with_the_same_args(tmp_path):
    python, calls = fake_python(tmp_path)
    proc = run_sh(tmp_path, python, ["--preset", "tiny", "--val_every=3", f"--log_dir={tmp_path / 'batch'}"], RUNS="3")
    assert proc.returncode == 0
    # with RUNS the arguments are the user's, plus --log_dir only when the user gave none (see test_claim_flow.py)
    assert trainer_calls(calls) == [f"train_gpt_medium.py --preset tiny --val_every=3 --log_dir={tmp_path / 'batch'}"] * 3
    assert [line for line in proc.stderr.splitlines() if "starting run" in line] == [
        f"run.sh: starting run {i} of 3" for i in (1, 2, 3)]


def test_run_sh_stops_at_the_first_failing_run_with_its_exit_status(tmp_path):
    python, calls = fake_python(tmp_path, fail_at=2, code=7)
    proc = run_sh(tmp_path, python, ["--preset", "tiny", f"--log_dir={tmp_path / 'batch'}"], RUNS="4")
    assert proc.returncode == 7
    assert len(trainer_calls(calls)) == 2
    assert "run 2 of 4 failed with exit status 7" in proc.stderr


def test_run_sh_without_runs_runs_once(tmp_path):
    python, calls = fake_python(tmp_path, fail_at=1, code=3)
    proc = run_sh(tmp_path, python, ["--preset", "tiny"])
    assert proc.returncode == 3 and len(calls.read_text().splitlines()) == 1
    assert "starting run" not in proc.stderr


def test_run_sh_rejects_a_bad_runs_count(tmp_path):
    python, calls = fake_python(tmp_path)
    proc = run_sh(tmp_path, python, [], RUNS="ten")
    assert proc.returncode == 2 and "RUNS=ten" in proc.stderr and not calls.exists()


def test_compare_refuses_a_set_that_mixes_experiments(tmp_path, capsys):
    a = make_set(tmp_path / "a", FAIL_LOSSES)
    b = make_set(tmp_path / "b", PASS_LOSSES)
    write_log(b / "zz_long.txt", 2.9140, 1500.0, steps=12)
    assert stats_cli.main(["--compare", str(a), str(b)]) == 2
    assert "split the folder or pass --pool" in capsys.readouterr().err
    assert stats_cli.main(["--compare", str(a), str(b), "--pool"]) == 0


def test_diff_script_entry_point_returns_exit_status(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "records" / "diff.py"), str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "nope" in proc.stderr


def test_text_report_also_gives_the_95_percent_bound_when_alpha_differs(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    stats_cli.main([str(folder)])  # default alpha 0.01
    out = capsys.readouterr().out
    assert "SPEC" not in out
    line = re.search(r"^one-sided 95% upper bound of mean=(\S+)$", out, re.M)
    x = np.asarray(PASS_LOSSES)
    expected = x.mean() + sps.t.ppf(0.95, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    assert float(line[1]) == pytest.approx(expected, abs=1e-6)


def test_a_finished_run_whose_final_loss_is_nan_counts_against_the_claim(tmp_path, capsys):
    """A diverged run's last val line says nan: it finished (it is not skipped as unfinished), and the
    claim cannot hold with it; the report says so, not "all losses are equal"."""
    folder = make_set(tmp_path / "r", PASS_LOSSES)
    write_log(folder / "diverged.txt", float("nan"), TIMES[0])
    code = stats_cli.main([str(folder)])
    out = capsys.readouterr().out
    assert code == 1 and f"{len(PASS_LOSSES) + 1} finished run(s), 0 skipped" in out
    assert "not a number (nan or inf: the run diverged)" in out and "claim does not hold" in out
    assert "equal" not in out
