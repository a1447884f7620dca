"""Tests of the record tools: records/stats.py (claim check, Welch comparison, log parsing) and records/diff.py.

Expected statistics are computed here from textbook formulas, not by calling the tools' code paths.
"""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"records_{name}", ROOT / "records" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


stats_cli = _load("stats")
diff_cli = _load("diff")

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


def write_log(path, loss, time_s, *, steps=10, decimals=6, finish=True, nan_avg=False, extra="", source=SOURCE):
    """A log in the SPEC section 5 format: source, versions block, step lines, peak memory."""
    ms = time_s * 1000

    def avg(t, s):
        return "nan" if nan_avg else f"{t / s:.2f}"

    lines = [source.rstrip("\n"), "", "=" * 100, "Python 3.11.7", "PyTorch 2.5.1", "NVIDIA H100 80GB HBM3", "=" * 100,
             f"step:0/{steps} val_loss:{10.8258:.{decimals}f} train_time:0ms step_avg:nanms"]
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
    parsed = stats_cli.parse_log(write_log(tmp_path / "a.txt", 2.917123, 1412.451))
    assert parsed.warnings == []
    assert (parsed.result.val_loss, parsed.result.train_time_s, parsed.result.steps) == (2.917123, 1412.451, 10)


@pytest.mark.parametrize("decimals", [4, 6])
def test_parse_log_reads_4_and_6_decimal_losses(tmp_path, decimals):
    parsed = stats_cli.parse_log(write_log(tmp_path / "a.txt", 2.9194, 1412.451, decimals=decimals))
    assert parsed.warnings == []
    assert parsed.result.val_loss == 2.9194


def test_parse_log_accepts_nan_step_avg(tmp_path):
    parsed = stats_cli.parse_log(write_log(tmp_path / "a.txt", 2.9194, 1412.451, nan_avg=True))
    assert parsed.warnings == []
    assert (parsed.result.val_loss, parsed.result.train_time_s) == (2.9194, 1412.451)


def test_parse_log_tolerates_extra_key_value_tokens(tmp_path):
    parsed = stats_cli.parse_log(write_log(tmp_path / "a.txt", 2.9194, 1412.451, extra=" val_bpb:1.234567 note:x"))
    assert parsed.warnings == []
    assert parsed.result.val_loss == 2.9194


def test_parse_log_reports_unfinished_run_with_last_step(tmp_path):
    parsed = stats_cli.parse_log(write_log(tmp_path / "a.txt", 2.9194, 1412.451, finish=False))
    assert parsed.result is None
    assert "did not finish" in parsed.skip_reason and "5/10" in parsed.skip_reason


def test_parse_log_warns_on_garbled_lines_with_file_and_line(tmp_path):
    path = write_log(tmp_path / "a.txt", 2.9194, 1412.451)
    lines = path.read_text().splitlines()
    garbled = ["step:7/10 train_time:98", "step:8/10 train_time:abcms step_avg:1.00ms",
               "step:10/10 val_loss:0.1x train_time:1ms step_avg:1.00ms"]
    path.write_text("\n".join(lines + garbled) + "\n")
    parsed = stats_cli.parse_log(path)
    assert len(parsed.warnings) == 3
    for i, warning in enumerate(parsed.warnings):
        assert warning.startswith(f"{path}:{len(lines) + i + 1}:")
    assert parsed.result.val_loss == 2.9194


def test_parse_log_truncated_final_val_line_is_not_used(tmp_path):
    path = write_log(tmp_path / "a.txt", 2.9194, 1412.451)
    text = path.read_text()
    path.write_text(text[: text.index("val_loss:2.919400") + len("val_loss:2.91")])
    parsed = stats_cli.parse_log(path)
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
    test_line = re.search(r"t=(\S+) p=(\S+) 95% upper bound of mean=(\S+)$", out, re.M)
    assert float(test_line[1]) == pytest.approx(t, abs=1e-4)
    assert float(test_line[2]) == pytest.approx(sps.t.cdf(t, 3), rel=1e-3)
    assert float(test_line[3]) == pytest.approx(x["mean"] + sps.t.ppf(0.95, 3) * x["std"] / 2, abs=1e-6)
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
    folder, where = passing_set_with_a_garbled_line(tmp_path, "step:10/10 val_loss:nan train_time:1ms step_avg:1.00ms")
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
