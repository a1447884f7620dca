"""records/runlogs.py: one log finder, one parse per log, one rule for "the same experiment" that
stats.py, ablate.py, diff.py and plot.py all obey (each checked here on the same pair of logs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_plot import write_run_log
from test_records import OUR_CONFIG, OUR_GROUPS, PASS_LOSSES, make_our_set, run_json, write_log

from records import ablate, diff, plot, runlogs, stats, summary

ROOT = Path(__file__).resolve().parents[1]


def our_log(path, seed, groups=OUR_GROUPS, **config):
    return write_log(path, 2.918, 1400.0, config={**OUR_CONFIG, "seed": seed, **config}, groups=groups)


# ---------------------------------------------------------------- the rule


def test_fields_of_the_experiment_groups_decide_and_bookkeeping_does_not(tmp_path):
    base = runlogs.read_log(our_log(tmp_path / "a.txt", 1))
    renamed = runlogs.read_log(our_log(tmp_path / "b.txt", 2, run_id="other", log_dir="elsewhere", preset="tiny"))
    faster = runlogs.read_log(our_log(tmp_path / "c.txt", 3, device="cuda"))  # an execution field
    changed = runlogs.read_log(our_log(tmp_path / "d.txt", 4, muon_lr=0.03))  # a recipe field
    assert runlogs.experiment_key(base) == runlogs.experiment_key(renamed)
    assert runlogs.experiment_key(base) != runlogs.experiment_key(faster)
    assert runlogs.experiment_key(base) != runlogs.experiment_key(changed)
    assert runlogs.experiment_config(base) == {"num_iterations": "10", "muon_lr": "0.025"}


def test_a_field_the_groups_line_does_not_name_counts(tmp_path):
    groups = {k: v for k, v in OUR_GROUPS.items() if k != "muon_lr"}
    log = runlogs.read_log(our_log(tmp_path / "a.txt", 1, groups=groups))
    assert "muon_lr" in runlogs.experiment_config(log)


def test_logs_without_group_lines_use_every_field_but_seed_run_id_and_log_dir(tmp_path):
    a = runlogs.read_log(our_log(tmp_path / "a.txt", 1, groups=None))
    b = runlogs.read_log(our_log(tmp_path / "b.txt", 2, groups=None, run_id="arm_s2", log_dir="elsewhere"))
    c = runlogs.read_log(our_log(tmp_path / "c.txt", 3, groups=None, preset="tiny"))  # bookkeeping, but not known
    assert runlogs.experiment_key(a) == runlogs.experiment_key(b)
    assert runlogs.experiment_key(a) != runlogs.experiment_key(c)
    assert runlogs.rule_of(a) == runlogs.FALLBACK_RULE


def test_upstream_logs_are_grouped_by_script_and_steps_only(tmp_path):
    a = runlogs.read_log(write_log(tmp_path / "a.txt", 2.918, 1400.0))
    b = runlogs.read_log(write_log(tmp_path / "b.txt", 2.917, 1401.0))
    c = runlogs.read_log(write_log(tmp_path / "c.txt", 2.917, 1401.0, steps=12))
    assert runlogs.experiment_key(a) == runlogs.experiment_key(b) != runlogs.experiment_key(c)
    assert runlogs.rule_of(a) == runlogs.UPSTREAM_RULE


def test_a_garbled_groups_line_is_a_warning_and_the_fallback_rule(tmp_path):
    path = our_log(tmp_path / "a.txt", 1)
    path.write_text(path.read_text().replace('config_groups = {', 'config_groups = {oops'))
    log = runlogs.read_log(path)
    assert log.groups is None and any("unreadable config_groups line" in w for w in log.warnings)
    assert runlogs.rule_of(log) == runlogs.FALLBACK_RULE


def test_the_trainer_writes_the_lines_the_rule_reads():
    tg = pytest.importorskip("train_gpt_medium")
    config = tg.make_config("tiny", seed=5)
    log = ablate.expected_log(tg, config)
    assert runlogs.has_groups(log) and log.experiment_groups == tuple(tg.EXPERIMENT_GROUPS)
    fields = runlogs.experiment_config(log)
    assert "muon_lr" in fields and "device" in fields and "seed" not in fields and "log_dir" not in fields


# ---------------------------------------------------------------- every tool obeys it


@pytest.fixture
def two_and_one(tmp_path):
    """A folder of 3 runs: 2 differing in bookkeeping only (one experiment), 1 with another muon_lr."""
    folder = make_our_set(tmp_path / "r", PASS_LOSSES[:2])
    make_our_set(folder, PASS_LOSSES[2:3], first_seed=200, muon_lr=0.03, run_id="x", log_dir="y")
    return folder


def test_stats_groups_by_the_rule(two_and_one, capsys):
    code, data = run_json(capsys, two_and_one)
    assert code == 2 and [len(g["runs"]) for g in data["groups"]] == [2, 1]
    assert [g["distinct"] for g in data["groups"]] == [{"muon_lr": "0.025"}, {"muon_lr": "0.03"}]


def test_diff_reports_only_experiment_fields(tmp_path, capsys):
    make_our_set(tmp_path / "2025-01-01_A", PASS_LOSSES[:1])
    new = make_our_set(tmp_path / "2025-02-01_B", PASS_LOSSES[:1], first_seed=7, run_id="b", log_dir="z", muon_lr=0.03)
    assert diff.main([str(new)]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(i for i, line in enumerate(out) if line.startswith("config 2025-01-01_A/"))
    assert "compared: the config fields of the groups recipe, seed ideas, execution" in out[i]
    assert out[i + 1:] == ["  muon_lr: 0.025 -> 0.03"]


def test_plot_draws_one_group_per_experiment(two_and_one, capsys):
    labels = [(label, len(runs)) for label, runs in plot.groups([str(two_and_one)])]
    assert labels == [("r [A: muon_lr=0.025]", 2), ("r [B: muon_lr=0.03]", 1)]
    assert "note: r holds 2 experiments" in capsys.readouterr().err


def test_plot_of_one_experiment_is_one_group(tmp_path):
    folder = make_our_set(tmp_path / "r", PASS_LOSSES[:3])
    assert [(label, len(runs)) for label, runs in plot.groups([str(folder)])] == [("r", 3)]


def test_plot_ablation_of_a_mixed_folder_has_one_arm_per_experiment(two_and_one):
    pytest.importorskip("matplotlib")
    out = two_and_one / "a.png"
    assert plot.main(["ablation", str(two_and_one), "-o", str(out)]) == 0 and out.exists()


def test_an_arm_with_runs_of_two_experiments_is_flagged_in_the_ablation_report(tmp_path):
    sweep = ablate.Sweep(preset="tiny", grid=[["lore_input", ["false", "true"]]], seeds=[1, 2])
    out = tmp_path / "out"
    (out).mkdir()
    (out / "sweep.json").write_text(json.dumps(ablate.asdict(sweep)))
    for arm in ("lore_input-false", "lore_input-true"):
        for seed in (1, 2):
            write_run_log(out / "logs" / arm / f"seed{seed}" / "run.txt", 3.0 + seed / 100, seed=seed)
    log = out / "logs" / "lore_input-true" / "seed2" / "run.txt"
    log.write_text(log.read_text().replace("config preset = 'tiny'", "config preset = 'tiny'\nconfig muon_lr = 0.03"))
    assert ablate.main(["--report-only", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "**Warning: arm `lore_input-true` holds runs of 2 different experiments**" in report
    assert "**Warning: arm `lore_input-false`" not in report


# ---------------------------------------------------------------- finding and caching


def test_find_logs_reads_each_file_once_and_names_a_missing_path(tmp_path):
    log = write_log(tmp_path / "a.txt", 2.918, 1400.0)
    assert runlogs.find_logs([tmp_path, log, tmp_path / "." / "a.txt"]) == [log]
    with pytest.raises(runlogs.LogError, match="no such file or folder: .*nope"):
        runlogs.find_logs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(runlogs.LogError, match=r"no \*\.txt logs in folder"):
        runlogs.find_logs([tmp_path / "empty"])
    assert runlogs.find_logs([tmp_path / "empty"], empty_ok=True) == []


def test_read_log_parses_a_file_again_only_when_it_changed(tmp_path, monkeypatch):
    calls = []
    parse = runlogs.parse_text
    monkeypatch.setattr(runlogs, "parse_text", lambda text, path, *a: calls.append(path) or parse(text, path, *a))
    path = write_log(tmp_path / "a.txt", 2.918, 1400.0, finish=False)
    assert not runlogs.read_log(path).finished and not runlogs.read_log(path).finished
    assert len(calls) == 1
    write_log(path, 2.918, 1400.0)  # the run finished: another size
    os.utime(path, ns=(1, 1))
    assert runlogs.read_log(path).finished and len(calls) == 2


def test_a_sweep_parses_each_finished_log_once(tmp_path, monkeypatch):
    """The sweep looks at every run's folder after each run; each log must still be parsed once."""
    from test_ablate import fake_sweep
    calls = []
    parse = runlogs.parse_text
    monkeypatch.setattr(runlogs, "parse_text", lambda text, path=Path("<text>"), *a: calls.append(Path(path))
                        or parse(text, path, *a))
    argv, _ = fake_sweep(tmp_path)
    assert ablate.main(argv) == 1  # one of the four fake runs writes no log
    logs = [p for p in calls if p.name.endswith(".txt") and "templates" not in str(p)]
    assert len(logs) == 3 and len(set(logs)) == 3, logs


# ---------------------------------------------------------------- imports


BLOCKER = """import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {module!r}:
            raise ImportError(name + " may not be imported here")
sys.meta_path.insert(0, Blocked())
sys.path.insert(0, {root!r})
"""


def _run_without(module, code):
    """Run `code` in a fresh interpreter in which importing `module` fails."""
    prelude = BLOCKER.format(module=module, root=str(ROOT))
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


def test_stats_and_diff_work_without_torch(tmp_path):
    folder = make_our_set(tmp_path / "2025-02-01_B", PASS_LOSSES)
    make_our_set(tmp_path / "2025-01-01_A", PASS_LOSSES[:2])
    proc = _run_without("torch", f"from records import stats, diff\n"
                                 f"assert stats.main([{str(folder)!r}, '--time-vs', 'bulk']) == 1\n"
                                 f"assert diff.main([{str(folder)!r}]) == 0\n"
                                 "assert 'torch' not in sys.modules")
    assert proc.returncode == 0, proc.stderr


def test_ablate_refuses_bad_arguments_before_importing_the_trainer(tmp_path):
    for argv in (["--seeds", "1,x"], ["--grid", "seed=1,2"], ["--grid", "a=1", "--out", str(tmp_path / "f.txt")]):
        (tmp_path / "f.txt").write_text("a file")
        proc = _run_without("torch", f"from records import ablate\nsys.exit(ablate.main({argv!r}))")
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1, \
            proc.stderr


def test_plot_refuses_a_bad_output_name_before_reading_or_drawing(tmp_path):
    proc = _run_without("torch", f"from records import plot\nsys.exit(plot.main(['curves', {str(tmp_path)!r}, "
                                 f"'-o', {str(tmp_path / 'x.jpgx')!r}]))")
    assert proc.returncode == 2 and proc.stderr.startswith("error: -o ") and ".jpgx" in proc.stderr


@pytest.mark.parametrize("script, argv", [("stats.py", ["--published"]), ("ablate.py", ["--help"]),
                                          ("plot.py", ["--help"]), ("diff.py", ["--help"])])
def test_scripts_import_their_siblings_through_the_package(script, argv):
    """Run as a script, each tool imports records.<name>: no bare `stats` (or `ablate`, ...) module
    exists beside scipy.stats."""
    code = (f"import runpy, sys\nsys.argv = [{script!r}, *{argv!r}]\ntry:\n"
            f"    runpy.run_path({str(ROOT / 'records' / script)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "import scipy.stats\n"
            "print(sorted(m for m in ('stats', 'ablate', 'plot', 'diff', 'runlogs', 'published') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_a_log_embeds_the_trainer_and_its_kernels_file_each_under_its_own_header(tmp_path):
    """The trainer's logged source is this script, then triton_kernels.py after a header of its own
    (as upstream's short-track logs embed theirs); runlogs splits it back into the two files, gives a
    folder's script the same digest as its logs, and reads a log from before the split as one file."""
    tg = pytest.importorskip("train_gpt_medium")
    source = tg.logged_source()
    files = runlogs.source_files(source)
    assert files == {"script": (ROOT / "train_gpt_medium.py").read_text(),
                     "triton_kernels.py": (ROOT / "triton_kernels.py").read_text()}
    assert runlogs.logged_source(ROOT / "train_gpt_medium.py") == source
    assert runlogs.source_files("print('one file')\n") == {"script": "print('one file')\n"}
    # a script that does not log a kernels file keeps its text alone, even with one beside it
    (tmp_path / "train_gpt.py").write_text("print('upstream medium')\n")
    (tmp_path / "triton_kernels.py").write_text("# kernels\n")
    assert runlogs.logged_source(tmp_path / "train_gpt.py") == "print('upstream medium')\n"
    log = tmp_path / "run.txt"
    log.write_text(source + "\n" + runlogs.SEPARATOR + "\nversions\n" + runlogs.SEPARATOR + "\nstep:1/1 train_time:1ms step_avg:1.00ms\n")
    assert runlogs.read_log(log).script == runlogs.script_digest(runlogs.logged_source(ROOT / "train_gpt_medium.py"))


# ---------------------------------------------------------------- how a run ended (its log's last line)


def stopped_log(path, how: str):
    """A run of ours that logged 5 of its 10 steps, then `run ended: <how>`."""
    write_log(path, 0.0, 0.0, finish=False, config={**OUR_CONFIG, "seed": 7}, groups=OUR_GROUPS)
    path.write_text(path.read_text() + f"run ended: {how}\n")
    return path


def test_an_interrupted_run_is_reported_as_interrupted_where_it_stopped(tmp_path, capsys):
    """stats.py and a batch's summary read the log's last line: not "did not finish" (a crash, a kill)
    but the stop and its step."""
    folder = make_our_set(tmp_path / "r", PASS_LOSSES)
    how = "interrupted by SIGINT at step 5/10 (exit 130)"
    log = runlogs.read_log(stopped_log(folder / "zz_stopped.txt", how))
    assert not log.finished and log.ended == how and log.skip_reason == how
    assert stats.main([str(folder)]) == 0
    assert f"  skipped {folder / 'zz_stopped.txt'}: {how}" in capsys.readouterr().out.splitlines()
    assert f"zz_stopped.txt: {how}" in summary.summary(folder)


def test_a_log_without_its_last_line_did_not_finish(tmp_path):
    """Killed (SIGKILL, the machine lost), or written before the line existed: the last step seen."""
    path = write_log(tmp_path / "a.txt", 0.0, 0.0, finish=False, config={**OUR_CONFIG, "seed": 7}, groups=OUR_GROUPS)
    log = runlogs.read_log(path)
    assert log.ended is None and log.skip_reason == "did not finish (last step seen: 5/10)"


def test_a_metrics_stream_says_how_its_run_ended_as_the_log_does(tmp_path):
    how = "interrupted by SIGTERM at step 3/10 (exit 143)"
    records = [dict(kind="run", step=0, num_iterations=10, config={}, script="abc"),
               dict(kind="step", step=3, train_time_ms=30.0, step_avg_ms=10.0), dict(kind="end", step=3, how=how)]
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = runlogs.read_log(path)
    assert log.ended == how and log.skip_reason == how
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))  # a stream cut short
    assert runlogs.parse_log(path).skip_reason == "did not finish (last step seen: 3/10)"
