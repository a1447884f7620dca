"""records/published.json (the upstream medium-track records as data) and how stats.py uses it:
--time-vs NAME, the report's line about the latest record, --published. The data also holds the
records claimed in unmerged upstream pull requests (#248, #252, #261), marked as claims.

The published summary figures in the data (each README's own mean, p and mean time) are checked
against the same figures recomputed here from the per-run lists, at the precision the README printed
them with; the run and step counts are those the upstream folders publish.
"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps
from test_records import PASS_LOSSES, TIMES, make_our_set, make_set, make_tiny_set, run_json

import train_gpt_medium as tg
from records import published
from records import stats as stats_cli

DATA = json.loads(published.DATA.read_text())
RECORDS = {r["recipe"] or r["name"]: r for r in DATA["records"]}
EXPECTED = {  # recipe: (date, steps, runs): what the upstream folders publish
    "x01": ("2025-09-11", 5690, 19), "snoo": ("2025-09-16", 5640, 30), "update_smoothing": ("2025-09-17", 5610, 160),
    "smoothed_snoo": ("2025-09-30", 5590, 160), "backout": ("2025-10-04", 5550, 22), "smear": ("2025-11-02", 5535, 26),
    "BlockMaskRedundantOp": ("2025-11-12", 5960, 1), "bulk": ("2025-12-31", 4740, 2),
    "fp8_yarn": ("2026-03-28", 4740, 5), "bigram": ("2026-04-07", 4620, 5), "mudd": ("2026-04-27", 4150, 6),
}
CLAIMS = {"fp8_yarn": 248, "bigram": 252, "mudd": 261}  # recipe: its unmerged upstream pull request
# Each claim's committed logs recomputed independently (scipy's one-sided t-test, ddof 1), to the
# precision kept here: n, mean loss, p (None: one log, no t-test), mean time in seconds.
RECOMPUTED_FROM_LOGS = {"fp8_yarn": (5, 2.91790, 1.08e-4, 1011.372), "bigram": (1, 2.9106, None, 950.425),
                      "mudd": (6, 2.91707, 6.2e-5, 860.478)}


def half_unit(x: float) -> float:
    """Half a unit in the last printed digit of x (its shortest repr): the rounding a README's figure carries."""
    text = repr(float(x))
    if "e" in text:
        mantissa, exponent = text.split("e")
        return 0.5 * 10 ** (int(exponent) - len(mantissa.replace("-", "").partition(".")[2]))
    return 0.5 * 10 ** -len(text.partition(".")[2])


def test_every_record_from_x01_on_is_there_with_its_step_count_and_run_count():
    assert {k: (r["date"], r["steps"], len(r["val_loss"])) for k, r in RECORDS.items()} == EXPECTED
    for r in DATA["records"]:
        # #261's folder is named 2026-0427-MuddFormer; a claim is faster than any merged record (860 s)
        undash = (lambda x: x.replace("-", "")) if "claim" in r else (lambda x: x)
        fastest = 800 if "claim" in r else 1000
        assert r["folder"].startswith("records/track_2_medium/") and undash(r["date"]) in undash(r["folder"])
        assert r["source"]
        if r["train_time_s"] is not None:
            assert len(r["train_time_s"]) == len(r["val_loss"])
        assert all(2.9 < x < 2.93 for x in r["val_loss"]) and all(fastest < t < 1600 for t in r["train_time_s"] or [])


@pytest.mark.parametrize("recipe", [k for k in EXPECTED if k != "BlockMaskRedundantOp"])
def test_published_means_and_p_are_recomputed_from_the_runs(recipe):
    r = RECORDS[recipe]
    pub, losses, times = r["published"], np.asarray(r["val_loss"]), np.asarray(r["train_time_s"])
    assert pub["n"] == len(losses)
    assert losses.mean() == pytest.approx(pub["mean_val_loss"], abs=half_unit(pub["mean_val_loss"]) + 1e-12)
    assert times.mean() == pytest.approx(pub["mean_train_time_s"], abs=max(half_unit(pub["mean_train_time_s"]), 0.003))
    p = sps.ttest_1samp(losses, 2.92, alternative="less").pvalue
    if pub["p"] is None:  # printed as 0.000000
        assert p < 5e-7
    else:
        assert p == pytest.approx(pub["p"], abs=half_unit(pub["p"]) + 1e-9 * pub["p"])


def test_the_logged_runs_are_in_the_lists_where_the_data_says_so():
    for r in DATA["records"]:
        pairs = list(zip(r["val_loss"], r["train_time_s"]))
        for log in r["logs"]:
            assert log["steps"] == r["steps"]
            assert ((log["val_loss"], log["train_time_s"]) in pairs) == log["in_list"], (r["name"], log["file"])


def test_the_module_reads_the_data():
    records = published.load()
    assert [r.recipe for r in records if r.recipe and r.merged] == ["x01", "snoo", "update_smoothing", "smoothed_snoo",
                                                                    "backout", "smear", "bulk"]
    assert published.names() == [r.recipe for r in records if r.recipe and r.merged]
    assert published.latest().recipe == "bulk" and published.latest().mean_train_time_s == pytest.approx(1041.277)
    assert published.find("Smear-MTP") is published.find("smear") and published.find("nope") is None


def test_a_record_with_only_a_mean_time_is_read_as_mean_and_n(tmp_path):
    doc = {"records": [{**RECORDS["bulk"], "train_time_s": None, "mean_train_time_s": 1041.28, "n_times": 2}]}
    (tmp_path / "p.json").write_text(json.dumps(doc))
    (r,) = published.load(tmp_path / "p.json")
    assert (r.train_time_s, r.mean_train_time_s, r.n_times) == (None, 1041.28, 2)


# ---------------------------------------------------------------- stats.py --time-vs NAME


FAST_TIMES = [1030.2, 1031.9, 1029.4, 1032.8, 1030.7, 1031.1]


def test_time_vs_a_published_name_is_welch_against_its_runs(tmp_path, capsys):
    code, data = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES, FAST_TIMES), "--time-vs", "bulk")
    bulk = RECORDS["bulk"]["train_time_s"]
    want = sps.ttest_ind(FAST_TIMES, bulk, equal_var=False, alternative="less")
    tv = data["time_vs"]
    assert tv["method"].startswith("Welch") and tv["reference_n"] == 2
    assert tv["p"] == pytest.approx(want.pvalue, rel=1e-9) and tv["df"] == pytest.approx(want.df, rel=1e-9)
    assert code == (0 if want.pvalue < 0.01 else 1) and tv["holds"] == (want.pvalue < 0.01)


def test_time_vs_a_published_mean_is_a_one_sample_test(tmp_path, capsys, monkeypatch):
    record = published.find("bulk")
    monkeypatch.setattr(published, "find", lambda name, records=None: published.PublishedRecord(
        **{**record.__dict__, "train_time_s": None, "mean_train_time_s": 1041.28, "n_times": 2}))
    _, data = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES, FAST_TIMES), "--time-vs", "bulk")
    tv = data["time_vs"]
    assert tv["method"].startswith("one-sample") and "published mean of 2 runs" in tv["reference"]
    assert tv["p"] == pytest.approx(sps.ttest_1samp(FAST_TIMES, 1041.28, alternative="less").pvalue, rel=1e-9)


def test_time_vs_a_record_with_one_published_time_is_a_one_sample_test_against_it(tmp_path, capsys):
    """Welch's test needs two runs on each side: a record that published one time is a number."""
    (time,) = RECORDS["BlockMaskRedundantOp"]["train_time_s"]
    _, data = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES, FAST_TIMES), "--time-vs", "BlockMaskRedundantOp")
    tv = data["time_vs"]
    assert tv["method"].startswith("one-sample") and "published mean of 1 run" in tv["reference"]
    assert tv["p"] == pytest.approx(sps.ttest_1samp(FAST_TIMES, time, alternative="less").pvalue, rel=1e-9)


def test_an_empty_time_vs_is_refused_not_matched_to_a_record(tmp_path, capsys):
    assert published.find("") is None
    assert stats_cli.main([str(make_set(tmp_path / "r", PASS_LOSSES)), "--time-vs", ""]) == 2
    assert capsys.readouterr().err.startswith("error: --time-vs is empty")


def test_time_vs_an_unknown_name_lists_the_published_ones(tmp_path, capsys):
    assert stats_cli.main([str(make_set(tmp_path / "r", PASS_LOSSES)), "--time-vs", "bulky"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --time-vs bulky: neither") and "x01, snoo" in err and "bulk)" in err


def test_time_vs_bulk_gives_tiny_cpu_runs_no_verdict(tmp_path, capsys):
    """Issue 24.5: tiny CPU runs were `faster` than bulk and the claim held, below `not compared`."""
    folder = make_tiny_set(tmp_path / "tiny")
    code, data = run_json(capsys, folder, "--time-vs", "bulk")
    assert code == 3 and data["verdict"] == "no verdict" and data["time_vs"]["p"] is None
    assert data["time_vs"]["note"].startswith("not compared: 3 of 3 run(s) ran on the CPU")
    assert stats_cli.main([str(folder), "--time-vs", "bulk"]) == 3
    out = capsys.readouterr().out
    assert "time verdict" not in out and "claim holds" not in out and "verdict at alpha=0.01: no verdict: " in out


@pytest.mark.parametrize("losses, argv, why", [
    ([3.2791, 3.2802, 3.2785], ["--target", "3.28"], "--target 3.28 is not the medium track's 2.92"),
    ([3.5012, 3.5023, 3.5007], [], "the runs are far from the 2.92 target"),
])
def test_time_vs_a_published_record_gives_runs_it_is_not_compared_with_no_verdict(tmp_path, capsys, losses, argv, why):
    code, data = run_json(capsys, make_set(tmp_path / "r", losses, FAST_TIMES), "--time-vs", "bulk", *argv)
    assert code == 3 and data["no_verdict"].startswith(f"--time-vs bulk is a medium-track record: {why}")
    assert data["latest_record"]["not_compared"].startswith(why)


# ---------------------------------------------------------------- unmerged claims (#248, #252, #261)


def test_each_claim_is_marked_unmerged_with_its_pull_request():
    assert {k for k, r in RECORDS.items() if "claim" in r} == set(CLAIMS)
    for recipe, pr in CLAIMS.items():
        claim, record = RECORDS[recipe]["claim"], published.find(recipe)
        assert claim["pr"] == pr and claim["merged"] is False and claim["url"].endswith(f"/pull/{pr}")
        assert (record.pr, record.merged, record.is_claim) == (pr, False, True)
        assert f"unmerged claim PR #{pr}" in record.label
    assert all(r.merged and r.pr is None for r in published.load() if r.recipe not in CLAIMS)
    assert published.claim_names() == list(CLAIMS) and not set(CLAIMS) & set(published.names())


@pytest.mark.parametrize("recipe", list(CLAIMS))
def test_a_claims_statistics_are_those_its_logs_give(recipe):
    """The logs' runs give the independently recomputed figures, at the precision kept, and the
    data's from_logs figures are the same."""
    r = RECORDS[recipe]
    losses, times = [x["val_loss"] for x in r["logs"]], [x["train_time_s"] for x in r["logs"]]
    n, mean, p, mean_time = RECOMPUTED_FROM_LOGS[recipe]
    got = r["claim"]["from_logs"]
    assert len(losses) == n == got["n"] and all(x["steps"] == r["steps"] for x in r["logs"])
    for value in (np.mean(losses), got["mean_val_loss"]):
        assert value == pytest.approx(mean, abs=half_unit(mean) + 1e-12)
    for value in (np.mean(times), got["mean_train_time_s"]):
        assert value == pytest.approx(mean_time, abs=half_unit(mean_time) + 1e-9)
    if p is None:  # one log: no t-test
        assert n == 1 and got["p"] is None and published.find(recipe).log_stats.p is None
    else:
        for value in (sps.ttest_1samp(losses, 2.92, alternative="less").pvalue, got["p"]):
            assert value == pytest.approx(p, abs=half_unit(p))


def test_bigram_lists_5_runs_but_committed_1_log():
    r = RECORDS["bigram"]
    assert len(r["val_loss"]) == len(r["train_time_s"]) == 5 and len(r["logs"]) == 1 and r["logs"][0]["in_list"]
    assert "only 1 log" in r["notes"] and "n = 1, no t-test" in r["notes"]


def test_the_latest_record_is_the_latest_merged_one_not_a_later_claim():
    records = published.load()
    assert records[-1].recipe == "mudd" and records[-1].is_claim  # the claims are newer than bulk
    assert published.latest().recipe == "bulk" and published.latest(records).merged
    assert published.find("bigram").recipe == "bigram" and published.find("BigramFusedCEUnifiedOpt").pr == 252


CLAIM_FAST_TIMES = [1005.1, 1006.3, 1004.8, 1005.9, 1006.0, 1005.4]


def test_time_vs_an_unmerged_claim_tests_against_it_and_says_it_is_unmerged(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES, CLAIM_FAST_TIMES)
    want = sps.ttest_ind(CLAIM_FAST_TIMES, RECORDS["fp8_yarn"]["train_time_s"], equal_var=False, alternative="less")
    code, data = run_json(capsys, folder, "--time-vs", "fp8_yarn")
    tv = data["time_vs"]
    assert tv["claim"]["pr"] == 248 and tv["claim"]["merged"] is False and "unmerged claim PR #248" in tv["reference"]
    assert tv["reference_n"] == 5 and tv["p"] == pytest.approx(want.pvalue, rel=1e-9)
    assert code == (0 if want.pvalue < 0.01 else 1) and data["latest_record"]["record"] == "bulk"
    assert stats_cli.main([str(folder), "--time-vs", "fp8_yarn"]) == code
    lines = capsys.readouterr().out.splitlines()
    (line,) = [x for x in lines if x.startswith("time reference: ")]
    assert line.startswith("time reference: fp8_yarn is an unmerged claim (PR #248, not merged upstream, ")
    assert "its 5 committed logs give n=5 mean loss 2.91790 p=0.000108 mean time 1011.372s" in line
    assert lines.index(line) + 1 == next(i for i, x in enumerate(lines) if x.startswith("time vs fp8_yarn"))


def test_time_vs_a_merged_record_carries_no_claim(tmp_path, capsys):
    _, data = run_json(capsys, make_set(tmp_path / "r", PASS_LOSSES, CLAIM_FAST_TIMES), "--time-vs", "bulk")
    assert data["time_vs"]["claim"] is None
    stats_cli.main([str(tmp_path / "r"), "--time-vs", "bulk"])
    assert "time reference:" not in capsys.readouterr().out


def test_time_vs_bigram_says_plainly_that_its_logs_give_one_run(tmp_path, capsys):
    folder = make_set(tmp_path / "r", PASS_LOSSES, [t - 60 for t in CLAIM_FAST_TIMES])
    assert stats_cli.main([str(folder), "--time-vs", "bigram"]) == 0  # 5 README times, Welch
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("time reference: "))
    assert "(PR #252, not merged upstream, " in line and "its README lists 5 runs" in line
    assert "its 1 committed log gives n=1" in line and "no t-test possible from the logs" in line
    assert "4 of the README's runs have no log" in line


def test_time_vs_a_claim_gives_tiny_cpu_runs_no_verdict_and_still_names_the_claim(tmp_path, capsys):
    folder = make_tiny_set(tmp_path / "tiny")
    code, data = run_json(capsys, folder, "--time-vs", "mudd")
    assert code == 3 and data["verdict"] == "no verdict" and data["time_vs"]["p"] is None
    assert data["time_vs"]["claim"]["pr"] == 261
    assert stats_cli.main([str(folder), "--time-vs", "mudd"]) == 3
    out = capsys.readouterr().out
    assert "time reference: mudd is an unmerged claim (PR #261" in out and "time verdict" not in out


def test_time_vs_an_unknown_name_lists_the_claims_too(tmp_path, capsys):
    assert stats_cli.main([str(make_set(tmp_path / "r", PASS_LOSSES)), "--time-vs", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "(x01, snoo, update_smoothing, smoothed_snoo, backout, smear, bulk), an unmerged claim " \
           "(fp8_yarn, bigram, mudd) nor" in err and len(err.splitlines()) == 1


def test_the_published_table_marks_the_claims(capsys):
    assert stats_cli.main(["--published", "--json"]) == 0
    rows = {r["recipe"] or r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for recipe, pr in CLAIMS.items():
        assert rows[recipe]["path"].endswith(f"(unmerged claim, PR #{pr})") and rows[recipe]["claim"]["pr"] == pr
    assert rows["bulk"]["claim"] is None
    assert stats_cli.main(["--published"]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
    assert len(notes) == 3 and "its 1 committed log gives n=1" in notes[1]


# ---------------------------------------------------------------- the latest record in every report


@pytest.mark.parametrize("times", [TIMES, FAST_TIMES])
def test_the_report_says_where_medium_runs_stand_against_the_latest_record(tmp_path, capsys, times):
    folder = make_set(tmp_path / "r", PASS_LOSSES, times)
    want = sps.ttest_ind(times, RECORDS["bulk"]["train_time_s"], equal_var=False, alternative="less").pvalue
    code, data = run_json(capsys, folder)
    assert code == 0  # the loss claim holds; without --time-vs the time is reported, not part of the verdict
    latest = data["latest_record"]
    assert latest["record"] == "bulk" and latest["not_compared"] is None
    assert latest["test"]["p"] == pytest.approx(want, rel=1e-9)
    stats_cli.main([str(folder)])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("against the latest published record"))
    verdict = "faster" if want < 0.01 else "not shown to be faster"
    assert re.search(rf"\(mean 1041\.28s over 2 runs\): {verdict} \(p=(\S+), Welch one-sided test\)", line)
    assert float(re.search(r"p=(\S+),", line)[1]) == pytest.approx(want, rel=1e-3)
    assert "add --time-vs bulk" in line


def test_cpu_and_tiny_runs_are_not_compared_with_the_published_record(tmp_path, capsys):
    folder = make_our_set(tmp_path / "r", PASS_LOSSES, preset="tiny")
    _, data = run_json(capsys, folder)
    assert data["latest_record"]["test"] is None and "tiny preset" in data["latest_record"]["not_compared"]
    far = make_set(tmp_path / "far", [4.05, 4.06, 4.04])
    _, data = run_json(capsys, far)
    assert "far from the 2.92 target" in data["latest_record"]["not_compared"]


def test_published_table_recomputes_every_record(capsys):
    assert stats_cli.main(["--published", "--json"]) == 0
    rows = {r["recipe"] or r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for name, r in RECORDS.items():
        assert rows[name]["val_loss"]["n"] == len(r["val_loss"])
        if len(r["val_loss"]) > 1:
            assert rows[name]["t_test"]["p"] == pytest.approx(
                sps.ttest_1samp(r["val_loss"], 2.92, alternative="less").pvalue, rel=1e-9)


# ---------------------------------------------------------------- --values with published lists


def test_a_published_list_with_dropped_trailing_zeros_gives_no_warning(capsys):
    smear = RECORDS["smear"]["val_loss"]  # 2.91906 and 2.91947 were printed as 2.919060 and 2.919470
    assert any(len(repr(x).partition(".")[2]) < 6 for x in smear)
    code, data = run_json(capsys, "--values", ",".join(map(repr, smear)))
    assert code == 0 and data["warnings"] == []
    assert data["t_test"]["p"] == pytest.approx(sps.ttest_1samp(smear, 2.92, alternative="less").pvalue, rel=1e-12)


def test_a_list_printed_with_4_decimals_still_warns(capsys):
    _, data = run_json(capsys, "--values", "2.9165,2.9166")
    assert data["warnings"] == ["2 of 2 run(s) give the loss with at most 4 decimals (--values item 1, --values item 2): "
                                "each loss is rounded by up to half a unit in the last digit, so p and the bound are "
                                "approximate"]


@pytest.mark.parametrize("line, message", [
    ("2.919 1404429", "is more than a day, not a training time in seconds; milliseconds? (1404429 ms = 1404.429 s)"),
    ("1404.429 2.919", "1404.429 is not a validation loss"),
])
def test_values_in_the_wrong_unit_or_order_are_refused_with_a_hint(tmp_path, capsys, line, message):
    values = tmp_path / "v.txt"
    values.write_text(f"2.918 1404.1\n{line}\n")
    assert stats_cli.main(["--values", str(values)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {values}:2: ") and message in err and len(err.splitlines()) == 1


def test_time_vs_seconds_that_are_milliseconds_are_refused(tmp_path, capsys):
    assert stats_cli.main([str(make_set(tmp_path / "r", PASS_LOSSES)), "--time-vs", "1041277"]) == 2
    assert "milliseconds?" in capsys.readouterr().err


def test_half_unit():
    assert (half_unit(2.9194), half_unit(1384.6224), half_unit(1.1266e-05)) == pytest.approx((5e-5, 5e-5, 5e-10))
    assert math.isclose(half_unit(0.0046), 5e-5)


def test_data_file_is_the_one_the_docs_name():
    assert published.DATA == Path(__file__).resolve().parents[1] / "records" / "published.json"


# ---------------------------------------------------------------- the trainer's recipes name the same records


@pytest.mark.parametrize("name", list(tg.RECIPES))
def test_each_recipe_quotes_its_published_record(name):
    """--help and gpu_check quote a recipe's record from the trainer's RECIPES, stats.py from
    published.json: the two agree on the record's folder, date, step count, runs and mean time. An
    unmerged claim is quoted as its committed logs give it (#252's README lists 5 runs, 1 log)."""
    recipe, record = tg.RECIPES[name], published.find(name)
    assert record.recipe == name and record.folder.endswith("/" + recipe.folder) and record.date == recipe.date
    assert record.steps == tg.make_config(recipe=name).num_iterations
    if record.is_claim:
        stats = record.log_stats
        assert (recipe.runs, recipe.p_value) == (stats.n, stats.p) and recipe.claim_pr == record.pr
        assert recipe.mean_time_s == pytest.approx(stats.mean_train_time_s, abs=0.005)
        return
    assert recipe.runs == len(record.val_loss) == record.n_times
    assert recipe.mean_time_s == pytest.approx(record.mean_train_time_s, abs=0.005)
