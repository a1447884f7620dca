"""Statistics for speedrun records: does a set of runs support the claim, and does an ablation matter?

    python records/stats.py [PATH ...] [--group G] [--target 2.92] [--alpha 0.01] [--time-vs SECONDS|NAME|PATH] [--pool] [--json]
    python records/stats.py --values FILE|a,b,c [--target ...] [--alpha ...] [--time-vs ...] [--json]
    python records/stats.py PATH ... --table [--target ...] [--alpha ...] [--pool] [--json]
    python records/stats.py --compare A B [--pool] [--json]
    python records/stats.py --published [--json]

PATH and A, B are log files or folders of logs (every *.txt in the folder, not recursive).
Without PATH the newest record folder under --records-dir is used (folder names `YYYY-MM-DD`,
`YYYY-MM-DD_Name` or `YYYY-MM-DD-Name`). NAME is a published upstream record (x01, snoo,
update_smoothing, smoothed_snoo, backout, smear, bulk; records/published.json) or a record claimed
in an unmerged upstream pull request (fp8_yarn #248, bigram #252, mudd #261), which the report
names as such.

Runs are grouped into experiments before any test (records/runlogs.py: the same embedded script,
the same step count, and the same value of every config field in the groups the log names as
experiment-defining; the seed, names and output folders do not count). Logs of more than one
experiment are reported group by group and refused as one claim: --group G tests group G alone,
--pool all of them as one set. A byte-identical copy of a log counts once.

A text report of runs near the 2.92 target also says where they stand against the latest
published record (Welch's one-sided test of the training times); --time-vs makes a time test
part of the verdict.

Exit status:
  0  the claim holds (mean loss below --target with p < --alpha, and, with --time-vs, the mean
     time below the reference with p < --alpha); --compare, --table, --published: the report was printed
  1  the claim does not hold (including: fewer than 2 runs, so no t-test)
  2  unusable input (missing path, no finished run, a bad flag or --values entry), or logs of
     more than one experiment without --group or --pool
  3  no verdict: the runs are not medium-track record runs, so no claim can hold (the logs show
     CPU, non-medium-preset or synthetic-data runs, whatever --target; every run far below 2.92
     against 2.92; --time-vs NAME for runs that record is not compared with; --time-vs PATH whose
     runs are such runs). The figures are printed; the verdict line says why
"""

import argparse
import json
import math
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository root instead of records/ on the path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from records import published, runlogs  # noqa: E402
from records.runlogs import RunLog, RunResult  # noqa: E402

# Targets of the speedrun tracks, for the hint when every run is far from the target given.
MEDIUM_TARGET = 2.92
KNOWN_TARGETS = {MEDIUM_TARGET: "GPT-2 Medium track", 3.28: "GPT-2 small (124M) track"}
FAR_FROM_TARGET = 0.1  # every run this far above (or below) the target: probably the wrong --target
POWER_LEVELS = (0.8, 0.9)
MAX_RUNS = 1_000_000  # the power search gives up beyond this many runs
MAX_TRAIN_SECONDS = 86_400  # a training time above a day is not in seconds (milliseconds, most likely)
MAX_LOSS = 30.0  # a val loss (nats per token) above this is not a loss: the columns are swapped
POWER_METHOD = ("noncentral-t power of the one-sided one-sample t-test, with the true mean and std "
                "taken to be the observed ones")
SINGLE_RUN_METHOD = "normal model with the observed mean and std"
FULL_PRECISION = 6  # decimals the trainer prints a loss with


class UnusableInput(Exception):
    """Input that gives no answer at all: a missing path, an unreadable file, no finished runs."""


# -----------------------------------------------------------------------------
# Sets of runs: logs grouped into experiments

def set_warnings(runs: list[RunResult], logs: list[RunLog] = (), exact_decimals: bool = True) -> list[str]:
    """Warnings about one set of runs: coarse losses, different printings mixed, repeated seeds.

    exact_decimals: the decimals are as printed (logs). Hand-typed values (--values) lose their
    trailing zeros (2.91920 reads as 2.9192), so there only the finest value says how the set was
    printed, and fewer decimals elsewhere prove nothing.
    """
    out = []
    runs = [r for r in runs if math.isfinite(r.val_loss)] or runs  # nan has no decimals (claim_test says it)
    finest = max(r.decimals for r in runs)
    coarse = [r for r in runs if r.decimals < FULL_PRECISION] if exact_decimals else \
        (list(runs) if finest < FULL_PRECISION else [])
    if coarse:
        names = ", ".join(str(r.path) for r in coarse[:3]) + (", ..." if len(coarse) > 3 else "")
        digits = min(r.decimals for r in coarse) if exact_decimals else finest
        out.append(f"{len(coarse)} of {len(runs)} run(s) give the loss with {'only' if exact_decimals else 'at most'} "
                   f"{digits} decimals ({names}): each loss is rounded by up to half a unit in the last digit, "
                   "so p and the bound are approximate")
        if exact_decimals and len(coarse) < len(runs):
            out.append(f"this set mixes {len(coarse)} coarse-decimal loss(es) with {len(runs) - len(coarse)} "
                       f"{FULL_PRECISION}-decimal one(s): were they printed by different scripts?")
    seeds: dict[str, list[str]] = {}
    for log in logs:
        if log.seed is not None:
            seeds.setdefault(log.seed, []).append(str(log.path))
    for seed, paths in seeds.items():
        if len(paths) > 1:
            out.append(f"runs {', '.join(paths)} share seed {seed}: not independent runs (give each run a fresh seed)")
    return out


@dataclass
class RunSet:
    """The runs read from some paths: every log (copies removed), its experiments, and what to warn about."""

    label: str
    paths: list
    parsed: list[RunLog]
    groups: list[runlogs.Experiment]
    warnings: list[str]
    duplicates: list[str]


def load_runs(paths: list[Path], label: str | None = None) -> RunSet:
    """Read, de-duplicate and group the logs at `paths`. Raises UnusableInput if no run finished."""
    label = label or ", ".join(map(str, paths))
    try:
        parsed = runlogs.read_logs(paths)
    except runlogs.LogError as e:
        raise UnusableInput(str(e)) from None
    parsed, duplicates = runlogs.drop_duplicates(parsed)
    finished = [p for p in parsed if p.finished]
    if not finished:
        raise UnusableInput(f"no finished runs in {label}")
    warnings = [w for p in parsed for w in p.warnings] + duplicates
    return RunSet(label, list(paths), parsed, runlogs.group_runs(finished), warnings, duplicates)


def selection_hint(rs: RunSet, command: str | None) -> str:
    """One line per group: how to test it alone (`command` with --group), and what sets it apart."""
    lines = []
    for g in rs.groups:
        what = f"{len(g.runs)} run(s), {g.differences(limit=4)}"
        lines.append(f"  {command} --group {g.name}    # {what}" if command else f"  group {g.name}: {what}")
    return "\n".join(lines)


def pooled_or_refused(rs: RunSet, pool: bool, what: str = "claim", command: str | None = None
                      ) -> tuple[list[RunLog], str | None]:
    """(the runs to test as one set, None) or (all runs, the refusal message) when `rs` mixes experiments.

    The refusal ends with how to choose: one command per group when `command` (the user's command
    line without --group) is given, else the groups and what sets each apart."""
    logs = [p for g in rs.groups for p in g.logs]
    if len(rs.groups) == 1:
        return logs, None
    names = ", ".join(g.name for g in rs.groups)
    if pool:
        rs.warnings.append(f"--pool: {len(rs.groups)} experiments (groups {names}) tested as one {what}")
        return logs, None
    head = (f"{rs.label} holds {len(rs.groups)} experiments (groups {names}: different scripts, configs "
            f"or step counts).")
    if command:
        return logs, (f"{head} Test one of them (or split the folder), or pass --pool to test them all as one "
                      f"{what}:\n{selection_hint(rs, command)}")
    return logs, (f"{head} Give one of them: split the folder or pass --pool to test them all as one {what}. "
                  f"The groups (`python records/stats.py {rs.label}` lists their runs):\n{selection_hint(rs, None)}")


def select_group(rs: RunSet, name: str) -> RunSet:
    """The RunSet narrowed to experiment `name` (--group)."""
    for g in rs.groups:
        if g.name == name:
            kept = {id(log) for log in g.logs}
            parsed = [p for p in rs.parsed if not p.finished or id(p) in kept]
            return RunSet(f"{rs.label} group {name}", rs.paths, parsed, [g], rs.warnings, rs.duplicates)
    raise UnusableInput(f"--group {name}: {rs.label} has no group {name}; its groups: "
                        + ", ".join(g.name for g in rs.groups))


# -----------------------------------------------------------------------------
# Statistics

def describe(values: list[float]) -> dict:
    """n, mean, sample std (ddof=1; None for n == 1), median, min, max."""
    a = np.asarray(values, dtype=np.float64)
    return {
        "n": len(a),
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if len(a) > 1 else None,
        "median": float(np.median(a)),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def _spread(values) -> float | None:
    """The sample std, or None when there is none to speak of (n < 2, or all values equal)."""
    a = np.asarray(values, dtype=np.float64)
    if len(a) < 2:
        return None
    std = float(a.std(ddof=1))
    return std if std > 1e-12 * max(1.0, abs(float(a.mean()))) else None


def level_label(alpha: float) -> str:
    """'99%' for alpha 0.01: the confidence level 1 - alpha of a one-sided bound."""
    return f"{100 * (1 - alpha):.10g}%"


def claim_test(losses: list[float], target: float, alpha: float) -> dict:
    """One-sided one-sample t-test, H1: mean < target, with one-sided upper bounds of the mean.

    `upper_bound` is at level 1 - alpha (`upper_bound_level`); `upper_bound_95` is the 95% one.
    With a single run, or runs that all gave the same loss, there is no spread to test against:
    no test, and the claim does not hold.
    """
    n = len(losses)
    none = {"t": None, "p": None, "df": None, "upper_bound": None, "upper_bound_level": 1 - alpha,
            "upper_bound_95": None, "holds": False}
    diverged = sum(not math.isfinite(x) for x in losses)
    if diverged:
        return {**none, "note": f"{diverged} of {n} finished run(s) ended with a final val_loss that is not a "
                                "number (nan or inf: the run diverged): such a run counts against the claim, "
                                "which cannot hold with it"}
    if n < 2:
        return {**none, "note": f"n = {n}: no sample std, so no t-test; a t-test needs at least 2 runs"}
    if _spread(losses) is None:
        return {**none, "note": f"all {n} losses are equal: no spread, so no t-test "
                                "(copies of one log, or runs with the same seed?)"}
    res = stats.ttest_1samp(losses, target, alternative="less")
    return {"t": float(res.statistic), "p": float(res.pvalue), "df": int(res.df),
            "upper_bound": float(res.confidence_interval(1 - alpha).high), "upper_bound_level": 1 - alpha,
            "upper_bound_95": float(res.confidence_interval(0.95).high),
            "holds": bool(res.pvalue < alpha), "note": None}


def t_test_power(effect: float, n: int, alpha: float) -> float:
    """The chance that n runs give p < alpha in the one-sided one-sample t-test, when the true mean lies
    `effect` standard deviations below the target: P(T > t_crit) for T noncentral t (n - 1 df, nc = effect * sqrt(n))."""
    return float(stats.nct.sf(stats.t.ppf(1 - alpha, n - 1), n - 1, effect * math.sqrt(n)))


def runs_for_power(effect: float, power: float, alpha: float) -> int | None:
    """The fewest runs (at least 2) whose t-test reaches `power`, or None if more than MAX_RUNS are needed."""
    if t_test_power(effect, 2, alpha) >= power:
        return 2
    low, high = 2, 4  # power(low) < power; double until power(high) >= power, then bisect (power rises with n)
    while t_test_power(effect, high, alpha) < power:
        if high >= MAX_RUNS:
            return None
        low, high = high, min(2 * high, MAX_RUNS)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if t_test_power(effect, mid, alpha) >= power else (mid, high)
    return high


def power_estimate(losses: list[float], target: float, alpha: float) -> dict:
    """How many runs a claim needs: for each power in POWER_LEVELS the fewest runs with that chance of p < alpha,
    and the power of this set's n, taking the true mean and std to be the observed ones (POWER_METHOD)."""
    out = {"method": POWER_METHOD, "effect_size": None, "power_at_n": None,
           **{f"runs_needed_{round(100 * p)}": None for p in POWER_LEVELS}, "note": None}
    if not all(math.isfinite(x) for x in losses):
        return {**out, "note": "a run's final val_loss is not a number (a diverged run)"}
    std = _spread(losses)
    if std is None:
        return {**out, "note": "needs at least 2 runs with different losses"}
    mean = float(np.mean(losses))
    if not mean < target:
        return {**out, "note": f"the observed mean {mean:.6f} is not below the target {target}: "
                               "no number of runs will give p < alpha"}
    effect = (target - mean) / std
    out.update(effect_size=effect, power_at_n=t_test_power(effect, len(losses), alpha))
    for p in POWER_LEVELS:
        out[f"runs_needed_{round(100 * p)}"] = runs_for_power(effect, p, alpha)
    if any(out[f"runs_needed_{round(100 * p)}"] is None for p in POWER_LEVELS):
        out["note"] = f"more than {MAX_RUNS:,} runs needed"
    return out


def single_run_chance(losses: list[float], target: float) -> dict:
    """The estimated chance that one more run lands below the target (SINGLE_RUN_METHOD)."""
    std = _spread(losses)
    p = None if std is None else float(stats.norm.cdf((target - float(np.mean(losses))) / std))
    return {"p": p, "method": SINGLE_RUN_METHOD}


def welch(a: list[float], b: list[float]) -> dict:
    """Welch's two-sample t-test of B against A (scipy's ttest_ind, equal_var=False): means, B - A,
    its 95% CI and the Welch-Satterthwaite df from scipy's result, t, two-sided p."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():  # identical runs: no spread
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_ind(b, a, equal_var=False)
        ci = res.confidence_interval(0.95)
    return {"mean_a": float(a.mean()), "mean_b": float(b.mean()), "diff_b_minus_a": float(b.mean() - a.mean()),
            "ci95": [float(ci.low), float(ci.high)], "df": float(res.df),
            "t": float(res.statistic), "p_two_sided": float(res.pvalue)}


def paired_test(a: list[float], b: list[float]) -> dict:
    """Paired t-test of B against A (a[i] and b[i] share seed i), scipy's ttest_rel(b, a): mean of
    B - A, its 95% CI, df, t, two-sided p.

    Pairing removes what the two runs of one seed have in common (the initial values of the
    tensors they share), so it can see smaller deltas than Welch's test. Fewer than 2 pairs, or
    deltas that are all equal, give nan where undefined.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired_test needs two equally long lists, got {a.shape} and {b.shape}")
    n = len(a)
    mean = float((b - a).mean()) if n else math.nan
    if n < 2:
        return {"n": n, "mean_diff": mean, "ci95": [math.nan, math.nan], "df": n - 1,
                "t": math.nan, "p_two_sided": math.nan}
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():  # all deltas equal: se = 0
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_rel(b, a)
        ci = res.confidence_interval(0.95)
    return {"n": n, "mean_diff": mean, "ci95": [float(ci.low), float(ci.high)], "df": int(res.df),
            "t": float(res.statistic), "p_two_sided": float(res.pvalue)}


@dataclass
class TimeReference:
    """What the training times are compared with: a number of seconds (a published mean, or one
    given), or the runs of another set (logs, or a published record's per-run times)."""

    label: str
    seconds: float | None = None
    times: list[float] | None = None
    record: str | None = None  # the published medium-track record's name, when it is one
    not_record_kind: str | None = None  # why the reference runs (a PATH) are not medium-track runs
    claim: dict | None = None  # an unmerged claim's pull request and what it is (claim_summary)


def time_test(times: list[float], ref: TimeReference, alpha: float) -> dict:
    """One-sided test that the mean training time is below the reference, at level alpha.

    Against a number: one-sample t-test (H1: mean < seconds) and the one-sided 1 - alpha upper bound of
    the mean. Against other runs: Welch's test (H1: mean < their mean) and the one-sided 1 - alpha upper
    bound of (mean - their mean), both from scipy's result.
    """
    base = {"reference": ref.label, "claim": ref.claim, "level": 1 - alpha, "t": None, "p": None, "df": None,
            "holds": False}
    if len(times) < 2:
        return {**base, "method": None, "note": "a time test needs at least 2 runs with a train time"}
    mean = float(np.mean(times))
    if ref.seconds is not None:
        if _spread(times) is None:
            return {**base, "method": None, "note": "all train times are equal: no spread, no t-test"}
        res = stats.ttest_1samp(times, ref.seconds, alternative="less")
        return {**base, "method": "one-sample t-test, H1: mean < reference", "mean": mean,
                "upper_bound": float(res.confidence_interval(1 - alpha).high),
                "t": float(res.statistic), "p": float(res.pvalue), "df": int(res.df),
                "holds": bool(res.pvalue < alpha), "note": None}
    if _spread(times) is None and _spread(ref.times) is None:
        return {**base, "method": None, "note": "no spread in either set of train times: no Welch test"}
    with warnings.catch_warnings():  # one set without spread is fine for Welch; scipy warns of cancellation
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_ind(times, ref.times, equal_var=False, alternative="less")
    ref_mean = float(np.mean(ref.times))
    return {**base, "method": "Welch's t-test, H1: mean < reference runs' mean", "mean": mean,
            "reference_mean": ref_mean, "reference_n": len(ref.times), "diff": mean - ref_mean,
            "upper_bound": float(res.confidence_interval(1 - alpha).high),
            "t": float(res.statistic), "p": float(res.pvalue), "df": float(res.df),
            "holds": bool(res.pvalue < alpha), "note": None}


def target_hint(losses: list[float], target: float, logs: list[RunLog] = ()) -> str | None:
    """A hint when every run is FAR_FROM_TARGET or more above (or below) the target: probably the wrong
    --target, unless the logs show runs that are not medium-track runs (a tiny, synthetic-data run's
    loss is on no track's scale: another target would not help)."""
    lo, hi, mean = min(losses), max(losses), float(np.mean(losses))
    if lo <= target + FAR_FROM_TARGET and hi >= target - FAR_FROM_TARGET:
        return None
    where = "above" if lo > target else "below"
    if not_record_kind(logs):
        return (f"every run is far {where} the target {target}, and they are not medium-track runs (the verdict "
                "says why): no --target makes them a record claim")
    near = [t for t in KNOWN_TARGETS if t != target and abs(mean - t) < FAR_FROM_TARGET]
    if near:
        t = min(near, key=lambda t: abs(mean - t))
        return f"every run is far {where} the target {target}; did you mean --target={t} ({KNOWN_TARGETS[t]})?"
    return f"every run is far {where} the target {target}; did you mean another --target?"


def claim_summary(record: published.PublishedRecord) -> dict | None:
    """An unmerged claim's pull request and one sentence on what backs it: the README's run list and
    what the committed logs give (a single log: n = 1, no t-test). None for a merged record."""
    if not record.is_claim:
        return None
    losses = list(record.val_loss)
    readme = f"its README lists {len(losses)} runs (mean loss {np.mean(losses):.5f}"
    if len(losses) >= 2 and _spread(losses) is not None:
        readme += f", p={stats.ttest_1samp(losses, MEDIUM_TARGET, alternative='less').pvalue:.3g}"
    readme += f", mean time {record.mean_train_time_s:.3f}s)"
    ls = record.log_stats
    if ls is None:
        logs = "no committed log gives figures"
    elif ls.p is None:
        logs = (f"its {ls.n} committed log{'s' if ls.n != 1 else ''} give{'s' if ls.n == 1 else ''} n={ls.n} "
                f"(mean loss {ls.mean_val_loss:.5f}, mean time {ls.mean_train_time_s:.3f}s): no t-test possible "
                f"from the logs, so the claim cannot be verified from them"
                + (f"; {len(losses) - ls.n} of the README's runs have no log" if len(losses) > ls.n else ""))
    else:
        logs = (f"its {ls.n} committed logs give n={ls.n} mean loss {ls.mean_val_loss:.5f} p={ls.p:.3g} "
                f"mean time {ls.mean_train_time_s:.3f}s")
    text = (f"{record.recipe or record.name} is an unmerged claim (PR #{record.pr}, not merged upstream, "
            f"{record.url}): {readme}; {logs}")
    return {"pr": record.pr, "merged": False, "url": record.url, "text": text}


def published_reference(record: published.PublishedRecord) -> TimeReference:
    """A published record as a time reference: its per-run times (Welch), or where fewer than two
    are published its mean, as a number (one-sample: Welch needs two runs on each side). An unmerged
    claim's reference carries what it is, which the report prints."""
    name, claim = record.recipe or record.name, claim_summary(record)
    if record.train_time_s is not None and len(record.train_time_s) >= 2:
        return TimeReference(f"{record.label}, published, {len(record.train_time_s)} runs",
                             times=list(record.train_time_s), record=name, claim=claim)
    return TimeReference(f"{record.label}, published mean of {record.n_times} run{'s' if record.n_times != 1 else ''}",
                         seconds=record.mean_train_time_s, record=name, claim=claim)


def not_record_kind(logs: list[RunLog]) -> str | None:
    """Why these runs are not medium-track record runs, read from their logs (a CPU device, another
    preset than medium, synthetic data), or None. Upstream logs, which log none of these, pass."""
    facts = {}
    for log in logs:
        preset = log.config.get("preset", "'medium'").strip("'")
        for fact, on in (("ran on the CPU", log.device == "cpu"), (f"used the {preset} preset", preset != "medium"),
                         ("trained on synthetic data", log.config.get("synthetic_data") == "True")):
            if on:
                facts.setdefault(fact, set()).add(id(log))
    if not facts:
        return None
    n = len(set().union(*facts.values()))
    return f"{n} of {len(logs)} run(s) {', '.join(facts)} (not medium-track runs)"


def not_medium_track(losses: list[float], target: float, logs: list[RunLog] = ()) -> str | None:
    """Why a set of runs is not compared with the published medium-track records, or None when it is:
    the target must be the medium track's, the runs near it, and none of them a CPU, tiny or synthetic run."""
    why = not_record_kind(logs)
    if why:
        return why
    if target != MEDIUM_TARGET:
        return f"--target {target} is not the medium track's {MEDIUM_TARGET}"
    if target_hint(losses, target):
        return f"the runs are far from the {MEDIUM_TARGET} target (not medium-track runs)"
    return None


def no_verdict_reason(losses: list[float], target: float, logs: list[RunLog] = (),
                      time_vs: TimeReference | None = None) -> str | None:
    """Why a set of runs gets no claim verdict at all, or None. A claim is a medium-track record's:
    runs the logs show are not medium-track runs (CPU, tiny preset, synthetic data) are never one,
    whatever --target; neither are runs far below 2.92 tested against it (another track, or synthetic
    data), nor runs timed against a published record that it would not compare them with, nor runs
    timed against reference runs that are not medium-track runs."""
    why = not_record_kind(logs)
    if why:
        return why
    if time_vs is not None and time_vs.not_record_kind:
        return f"the --time-vs reference {time_vs.label}: {time_vs.not_record_kind}"
    if target == MEDIUM_TARGET and max(losses) < target - FAR_FROM_TARGET:
        return (f"every run is far below the {MEDIUM_TARGET} target "
                "(not medium-track runs: synthetic data, another track?)")
    if time_vs is not None and time_vs.record is not None:
        why = not_medium_track(losses, target, logs)
        if why:
            return f"--time-vs {time_vs.record} is a medium-track record: {why}"
    return None


def against_latest(losses: list[float], times: list[float], target: float, alpha: float,
                   logs: list[RunLog] = ()) -> dict:
    """Where a set stands against the latest published record: its time test when the runs are
    medium-track runs with times, else why not."""
    record = published.latest()
    why_not = not_medium_track(losses, target, logs)
    if why_not is None and len(times) < 2:
        why_not = "no training times" if not times else "a time test needs at least 2 runs with a training time"
    out = {"record": record.recipe, "label": record.label, "mean_train_time_s": record.mean_train_time_s,
           "n": record.n_times, "not_compared": why_not, "test": None}
    if why_not is None:
        out["test"] = time_test(times, published_reference(record), alpha)
    return out


def analyse(losses: list[float], times: list[float | None], target: float, alpha: float,
            time_vs: TimeReference | None = None, logs: list[RunLog] = ()) -> dict:
    """Every figure of the claim check for one set of runs; `holds` is the overall verdict."""
    known_times = [t for t in times if t is not None]
    out = {"val_loss": describe(losses), "t_test": claim_test(losses, target, alpha),
           "power": power_estimate(losses, target, alpha), "single_run_below": single_run_chance(losses, target),
           "train_time_s": describe(known_times) if known_times else None, "time_vs": None,
           "hint": target_hint(losses, target, logs), "latest_record": against_latest(losses, known_times, target, alpha, logs)}
    out["no_verdict"] = no_verdict_reason(losses, target, logs, time_vs)
    if time_vs is not None:
        if out["no_verdict"] and time_vs.record is not None:  # a published record's time is no yardstick for them
            out["time_vs"] = {"reference": time_vs.label, "claim": time_vs.claim, "level": 1 - alpha, "method": None,
                              "t": None, "p": None, "df": None, "holds": False,
                              "note": f"not compared: {out['no_verdict']}"}
        else:
            out["time_vs"] = time_test(known_times, time_vs, alpha)
    out["holds"] = (out["no_verdict"] is None and out["t_test"]["holds"]
                    and (out["time_vs"] is None or out["time_vs"]["holds"]))
    out["verdict"] = ("no verdict" if out["no_verdict"] else "claim holds" if out["holds"] else "claim does not hold")
    return out


def exit_status(a: dict) -> int:
    """The claim's exit status: 0 holds, 1 does not hold, 3 no verdict (see the module docstring)."""
    return 0 if a["holds"] else 3 if a["no_verdict"] else 1


# -----------------------------------------------------------------------------
# Text report

def json_safe(obj):
    """obj with nan and infinities replaced by None, which strict JSON can carry."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _describe_line(name: str, d: dict, spec: str) -> str:
    std = "n/a" if d["std"] is None else format(d["std"], spec)
    return (f"{name}: n={d['n']} mean={d['mean']:{spec}} std={std} "
            f"median={d['median']:{spec}} min={d['min']:{spec}} max={d['max']:{spec}}")


def _report_runs(parsed: list[RunLog], out: list[str]) -> None:
    for p in parsed:
        if p.result:
            r = p.result
            time = "n/a" if r.train_time_s is None else f"{r.train_time_s:.3f}s"
            out.append(f"  run {p.path}: val_loss={r.val_loss:.{max(r.decimals, 4)}f} train_time={time}")
        else:
            out.append(f"  skipped {p.path}: {p.skip_reason}")


def _power_line(pw: dict, n: int, alpha: float) -> str:
    if pw["effect_size"] is None:
        return f"runs needed for p < {alpha}: {pw['note']}"
    needed = []
    for p in POWER_LEVELS:
        runs = pw[f"runs_needed_{round(100 * p)}"]
        count = f"more than {MAX_RUNS:,} runs" if runs is None else f"{runs} runs" + (f" ({runs - n} more)" if runs > n else "")
        needed.append(f"{round(100 * p)}% chance: {count}")
    return (f"runs needed for p < {alpha}: {', '.join(needed)}; this set's {n} runs had a "
            f"{pw['power_at_n']:.2f} chance ({pw['method']})")


def _time_test_text(tv: dict) -> str:
    level = f"{100 * tv['level']:.10g}%"
    if "reference_mean" in tv:
        return (f"Welch one-sided, H1: mean < {tv['reference_mean']:.3f}s, the mean of its {tv['reference_n']} runs): "
                f"difference={tv['diff']:.3f}s {level} upper bound of difference={tv['upper_bound']:.3f}s "
                f"t={tv['t']:.4f} p={tv['p']:.4g}")
    return (f"one-sample t, H1: mean < {tv['reference']}): {level} upper bound of mean={tv['upper_bound']:.3f}s "
            f"t={tv['t']:.4f} p={tv['p']:.4g}")


def _time_vs_line(tv: dict, verdict: bool = True) -> list[str]:
    """The time test's lines (first, for an unmerged claim, what it is); its verdict line only when
    the set gets a verdict at all."""
    claim = [f"time reference: {tv['claim']['text']}"] if tv.get("claim") else []
    if tv["note"]:
        tested = "" if tv["note"].startswith("not compared") else "not tested: "
        return claim + [f"time vs {tv['reference']}: {tested}{tv['note']}"]
    return claim + [f"time vs {tv['reference']} ({_time_test_text(tv)}"] + \
        [f"time verdict: {'faster' if tv['holds'] else 'not shown to be faster'}"] * verdict


def _latest_line(lr: dict, time_vs: dict | None) -> str:
    head = f"against the latest published record, {lr['label']} (mean {lr['mean_train_time_s']:.2f}s over {lr['n']} runs)"
    if lr["not_compared"]:
        return f"{head}: not compared: {lr['not_compared']}"
    tv = lr["test"]
    if tv["note"]:
        return f"{head}: not tested: {tv['note']}"
    if time_vs is not None and time_vs.get("reference") == tv["reference"]:
        return f"{head}: the time test above"
    verdict = "faster" if tv["holds"] else "not shown to be faster"
    p = f"p={tv['p']:.4g}, {'Welch one-sided' if 'reference_mean' in tv else 'one-sample one-sided'} test"
    return (f"{head}: {verdict} ({p}); a record must also beat it: add --time-vs {lr['record']} "
            "to make this part of the verdict")


def analysis_lines(a: dict, target: float, alpha: float) -> list[str]:
    """The text report of analyse()'s result, one figure per line."""
    loss, test, n = a["val_loss"], a["t_test"], a["val_loss"]["n"]
    out = [_describe_line("final val loss", loss, ".6f")]
    if test["note"]:
        out.append(f"t-test against {target} not possible: {test['note']}")
    else:
        out.append(f"one-sided t-test against {target} (H1: mean < {target}): t={test['t']:.4f} p={test['p']:.4g} "
                   f"{level_label(alpha)} upper bound of mean={test['upper_bound']:.6f}")
        if alpha != 0.05:  # the 95% bound is the figure upstream READMEs publish, whatever alpha the claim uses
            out.append(f"one-sided 95% upper bound of mean={test['upper_bound_95']:.6f}")
    if a["hint"]:
        out.append(f"hint: {a['hint']}")
    out.append(_power_line(a["power"], n, alpha))
    below = a["single_run_below"]
    if below["p"] is not None:
        out.append(f"chance that one run lands below {target}: {below['p']:.3f} ({below['method']})")
    if a["train_time_s"]:
        out.append(_describe_line("train_time (s)", a["train_time_s"], ".3f"))
    if a["time_vs"]:
        out.extend(_time_vs_line(a["time_vs"], verdict=not a["no_verdict"]))
    if a.get("latest_record"):
        out.append(_latest_line(a["latest_record"], a["time_vs"]))
    if a["no_verdict"]:
        out.append(f"verdict at alpha={alpha}: no verdict: {a['no_verdict']}")
    else:
        out.append(f"verdict at alpha={alpha}: {a['verdict']}")
    return out


def _print_warnings(warnings: list[str]) -> None:
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)


def _run_json(run: RunResult, group: str | None = None) -> dict:
    out = {"path": str(run.path), "steps": run.steps, "val_loss": run.val_loss,
           "train_time_s": run.train_time_s, "decimals": run.decimals}
    return out if group is None else {**out, "group": group}


# -----------------------------------------------------------------------------
# Commands

def _analyse_logs(logs: list[RunLog], args, time_vs: TimeReference | None) -> tuple[dict, list[str]]:
    runs = [p.result for p in logs]
    a = analyse([r.val_loss for r in runs], [r.train_time_s for r in runs], args.target, args.alpha, time_vs, logs)
    return a, set_warnings(runs, logs)


def check_seconds(seconds: float, what: str) -> None:
    """A training time that cannot be seconds: UnusableInput with the likely unit."""
    if seconds > MAX_TRAIN_SECONDS:
        raise UnusableInput(f"{what}: {seconds:.15g} s is more than a day, not a training time in seconds; "
                            f"milliseconds? ({seconds:.15g} ms = {seconds / 1000:.15g} s): give seconds")


def _record_choices() -> str:
    """The names --time-vs accepts, merged records first, e.g. `(x01, ..., bulk), an unmerged claim (mudd)`."""
    claims = published.claim_names()
    return f"({', '.join(published.names())})" + (f", an unmerged claim ({', '.join(claims)})" if claims else "")


def time_reference(spec: str | None, pool: bool) -> TimeReference | None:
    """--time-vs: a number of seconds, a published record's name, or a log file / folder whose runs'
    train times are the reference. A bare name that is both a record and a local folder means the
    record (write ./NAME for the folder)."""
    if spec is None:
        return None
    if not spec.strip():
        raise UnusableInput(f"--time-vs is empty: give a number of seconds, a published record {_record_choices()} "
                            "or a log folder")
    try:
        seconds = float(spec)
    except ValueError:
        seconds = None
    if seconds is not None:
        if not (math.isfinite(seconds) and seconds > 0):
            raise UnusableInput(f"--time-vs {spec}: give a positive number of seconds, a published record or a log folder")
        check_seconds(seconds, f"--time-vs {spec}")
        return TimeReference(f"{seconds:g}s", seconds=seconds)
    record = published.find(spec) if "/" not in spec else None
    if record is not None:
        if Path(spec).exists():
            _print_warnings([f"--time-vs {spec}: the published record {record.label}; for the folder write ./{spec}"])
        return published_reference(record)
    if not Path(spec).exists():
        raise UnusableInput(f"--time-vs {spec}: neither a number of seconds, a published record {_record_choices()} "
                            "nor an existing log file or folder")
    rs = load_runs([Path(spec)])
    logs, refusal = pooled_or_refused(rs, pool, "reference")
    if refusal:
        raise UnusableInput(f"--time-vs: {refusal}")
    _print_warnings(rs.warnings)
    times = [p.result.train_time_s for p in logs]
    if len(times) < 2:
        raise UnusableInput(f"--time-vs {spec}: Welch's test needs at least 2 finished reference runs, found {len(times)}")
    return TimeReference(spec, times=times, not_record_kind=not_record_kind(logs))


def _command_line(args) -> str:
    """The user's claim command, for the per-group commands of a refusal."""
    parts = ["python", "records/stats.py", *map(str, args.paths)]
    for flag, value in (("--target", args.target if args.target != MEDIUM_TARGET else None),
                        ("--alpha", args.alpha if args.alpha != 0.01 else None), ("--time-vs", args.time_vs)):
        if value is not None:
            parts += [flag, str(value)]
    return shlex.join(parts)


def _run_claim(args) -> int:
    try:
        paths = args.paths or [runlogs.newest_record(args.records_dir)]
    except runlogs.LogError as e:
        raise UnusableInput(str(e)) from None
    rs = load_runs(paths)
    if args.group:
        rs = select_group(rs, args.group)
    time_vs = time_reference(args.time_vs, args.pool)
    logs, refusal = pooled_or_refused(rs, args.pool, command=_command_line(args) if args.paths else None)
    groups, warnings = [], list(rs.warnings)
    for g in rs.groups:
        a, w = _analyse_logs(g.logs, args, time_vs)
        groups.append({"name": g.name, "key": g.describe_key(), "distinct": g.distinct,
                       "runs": [str(r.path) for r in g.runs], "analysis": a})
        if refusal:  # otherwise the tested set's warnings below cover these runs
            warnings += [f"group {g.name}: {x}" for x in w]
    claim = None
    if not refusal:
        claim, w = _analyse_logs(logs, args, time_vs)
        warnings += w
    if args.json:
        payload = {"paths": [str(p) for p in paths], "group": args.group, "target": args.target, "alpha": args.alpha,
                   "runs": [_run_json(r, g.name) for g in rs.groups for r in g.runs],
                   "skipped": [{"path": str(p.path), "reason": p.skip_reason} for p in rs.parsed if not p.finished],
                   "warnings": warnings, "duplicates": rs.duplicates, "groups": groups,
                   "pooled": len(rs.groups) > 1 and args.pool, "refused": refusal}
        claim_keys = ("val_loss", "t_test", "power", "single_run_below", "train_time_s", "time_vs", "latest_record",
                      "hint", "no_verdict")
        payload.update({k: claim[k] if claim else None for k in claim_keys})
        payload["verdict"] = claim["verdict"] if claim else "refused"
        print(json.dumps(json_safe(payload), indent=2))
    else:
        _print_warnings(warnings)
        finished = sum(len(g.runs) for g in rs.groups)
        head = f"logs: {', '.join(map(str, paths))}" + (f" (group {args.group})" if args.group else "")
        out = [head, f"{finished} finished run(s), {len(rs.parsed) - finished} skipped"]
        if len(rs.groups) == 1:
            _report_runs(rs.parsed, out)
            out.append(f"experiment: {rs.groups[0].describe_key()}")
        else:
            _report_runs([p for p in rs.parsed if not p.finished], out)
            out.append(f"{len(rs.groups)} experiments in these logs (different scripts, configs or step counts):")
            for g, info in zip(rs.groups, groups):
                out.append(f"group {g.name}: {len(g.runs)} run(s), {info['key']}")
                _report_runs(g.logs, out)
                out.extend("  " + line for line in analysis_lines(info["analysis"], args.target, args.alpha))
            if claim:
                out.append(f"all {finished} runs pooled (--pool):")
        if claim:
            out.extend(analysis_lines(claim, args.target, args.alpha))
        print("\n".join(out))
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    return exit_status(claim)


def parse_values(spec: str) -> list[RunResult]:
    """--values: a file with one `loss` or `loss time_s` per line (blank lines and # comments skipped),
    or a comma-separated list of losses. Raises UnusableInput naming the file and line of a bad entry,
    a loss that cannot be one, or a time that cannot be in seconds."""
    path = Path(spec)
    if path.is_file():
        try:
            lines = [(f"{path}:{i}", line.split("#")[0].replace(",", " ").split())
                     for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)]
        except (OSError, UnicodeDecodeError) as e:
            raise UnusableInput(f"--values: cannot read {path}: {e}") from e
        entries = [(where, fields) for where, fields in lines if fields]
    else:
        entries = [(f"--values item {i}", [item.strip()]) for i, item in enumerate(spec.split(","), start=1)]
    runs = []
    for where, fields in entries:
        try:
            numbers = [float(f) for f in fields]
        except ValueError:
            hint = "" if path.is_file() or "," in spec else " (no such file either)"
            raise UnusableInput(f"{where}: {' '.join(fields)!r} is not a number{hint}; "
                                "write one `loss` or `loss time_s` per line, or a,b,c") from None
        if len(numbers) > 2 or not all(map(math.isfinite, numbers)):
            raise UnusableInput(f"{where}: expected `loss` or `loss time_s`, got {' '.join(fields)!r}")
        if not 0 < numbers[0] <= MAX_LOSS:
            raise UnusableInput(f"{where}: {fields[0]} is not a validation loss (nats per token, 0 to {MAX_LOSS:g}); "
                                "is it a time? write `loss time_s` on each line, loss first")
        if len(numbers) == 2:
            if not numbers[1] > 0:
                raise UnusableInput(f"{where}: {fields[1]} is not a training time in seconds")
            check_seconds(numbers[1], where)
        decimals = len(fields[0].partition(".")[2])
        runs.append(RunResult(Path(where), 0, numbers[0], numbers[1] if len(numbers) == 2 else None, decimals))
    if not runs:
        raise UnusableInput(f"--values {spec}: no values")
    if len({r.train_time_s is None for r in runs}) > 1:
        raise UnusableInput(f"--values {spec}: give a time on every line or on none")
    return runs


def _run_values(args) -> int:
    runs = parse_values(args.values)
    time_vs = time_reference(args.time_vs, args.pool)
    if time_vs is not None and runs[0].train_time_s is None:
        raise UnusableInput("--time-vs needs train times: write `loss time_s` on each line of the --values file")
    claim = analyse([r.val_loss for r in runs], [r.train_time_s for r in runs], args.target, args.alpha, time_vs)
    warnings = set_warnings(runs, exact_decimals=False)
    if args.json:
        print(json.dumps(json_safe({"values": args.values, "target": args.target, "alpha": args.alpha,
                                     "runs": [_run_json(r) for r in runs], "warnings": warnings, **claim}), indent=2))
    else:
        _print_warnings(warnings)
        print("\n".join([f"values: {args.values} ({len(runs)} run(s))"]
                        + analysis_lines(claim, args.target, args.alpha)))
    return exit_status(claim)


def table_rows(args, time_vs: TimeReference | None) -> list[dict]:
    """One row per PATH and experiment (per PATH with --pool); an unusable PATH gives a row with its error.

    A folder without logs that is not named like a record folder is left out.
    """
    rows = []
    for path in args.paths:
        if Path(path).is_dir() and runlogs.record_name(Path(path).name) is None and not any(Path(path).glob("*.txt")):
            continue  # records/*/ also matches folders that are not records, such as __pycache__
        try:
            rs = load_runs([path])
        except UnusableInput as e:
            rows.append({"path": str(path), "group": None, "error": str(e)})
            continue
        if args.pool:
            logs, _ = pooled_or_refused(rs, pool=True)
            sets = [(None, logs)]
        else:
            sets = [(g.name if len(rs.groups) > 1 else None, g.logs) for g in rs.groups]
        for i, (group, logs) in enumerate(sets):
            a, w = _analyse_logs(logs, args, time_vs)
            warnings = (rs.warnings if i == 0 else []) + [f"group {group}: {x}" if group else x for x in w]
            rows.append({"path": str(path), "group": group, "warnings": warnings, "error": None, **a})
    return rows


def _table_cells(row: dict, alpha: float, with_time_test: bool) -> list[str]:
    """The header (row None) or one row of the table, as strings."""
    if row is None:
        return (["set", "n", "mean", "std", "p", f"{level_label(alpha)} bound", "mean time (s)"]
                + ["time p"] * with_time_test + ["verdict"])
    label = row["path"] + (f" [{row['group']}]" if row["group"] else "")
    if row["error"]:
        return [label] + [""] * (6 + with_time_test) + [f"error: {row['error']}"]

    def num(x, spec):
        return "n/a" if x is None else format(x, spec)
    loss, test, time = row["val_loss"], row["t_test"], row["train_time_s"]
    verdict = ("no verdict" if row["no_verdict"] else ("holds" if row["holds"] else "does not hold")
               if test["p"] is not None else "no t-test")
    time_p = [num(row["time_vs"]["p"], ".3g")] if with_time_test else []
    return ([label, str(loss["n"]), num(loss["mean"], ".6f"), num(loss["std"], ".6f"), num(test["p"], ".3g"),
             num(test["upper_bound"], ".6f"), num(time["mean"] if time else None, ".3f")] + time_p + [verdict])


def _print_table(rows: list[dict], header: str, alpha: float, with_time_test: bool) -> None:
    cells = [_table_cells(r, alpha, with_time_test) for r in [None] + rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    print(header)
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())


def _run_table(args) -> int:
    if not args.paths:
        raise UnusableInput("--table needs the folders to tabulate, e.g. records/*/")
    time_vs = time_reference(args.time_vs, args.pool)
    rows = table_rows(args, time_vs)
    if args.json:
        print(json.dumps(json_safe({"target": args.target, "alpha": args.alpha, "rows": rows}), indent=2))
    else:
        _print_warnings([f"{r['path']}: {w}" for r in rows for w in r.get("warnings") or ()])
        _print_table(rows, f"target {args.target}, alpha {args.alpha}" + (f", time vs {time_vs.label}" if time_vs else ""),
                     args.alpha, time_vs is not None)
    return 2 if not rows or all(r["error"] for r in rows) else 0


def _run_published(args) -> int:
    """--published: one row per published record, its figures recomputed from the data."""
    rows = []
    for r in published.load():
        times = list(r.train_time_s) if r.train_time_s else [None] * len(r.val_loss)
        a = analyse(list(r.val_loss), times, args.target, args.alpha)
        if r.train_time_s is None:
            a["train_time_s"] = {"mean": r.mean_train_time_s, "n": r.n_times}
        claim = f" (unmerged claim, PR #{r.pr})" if r.is_claim else ""
        rows.append({"path": f"{r.recipe or '-'} {r.date} {r.name}{claim}", "group": None, "error": None,
                     "recipe": r.recipe, "name": r.name, "date": r.date, "steps": r.steps,
                     "source": f"{r.folder}: {r.source}", "claim": claim_summary(r), **a})
    if args.json:
        print(json.dumps(json_safe({"target": args.target, "alpha": args.alpha, "rows": rows}), indent=2))
    else:
        _print_table(rows, f"published upstream medium-track records (records/published.json), target {args.target}, "
                           f"alpha {args.alpha}", args.alpha, False)
        print("\n".join(f"note: {r['claim']['text']}" for r in rows if r["claim"]))
    return 0


def _run_compare(args) -> int:
    a_path, b_path = args.compare
    sets = []
    for path in (a_path, b_path):
        rs = load_runs([path])
        logs, refusal = pooled_or_refused(rs, args.pool, "set")
        if refusal:
            raise UnusableInput(refusal)
        _print_warnings(rs.warnings)
        if len(logs) < 2:
            raise UnusableInput(f"{path}: Welch's test needs at least 2 finished runs per set, found {len(logs)}")
        sets.append((rs.parsed, [p.result for p in logs]))
    (pa, ra), (pb, rb) = sets
    loss = welch([r.val_loss for r in ra], [r.val_loss for r in rb])
    time = welch([r.train_time_s for r in ra], [r.train_time_s for r in rb])
    if args.json:
        print(json.dumps(json_safe({
            "a": {"path": a_path, "n": len(ra), "skipped": sum(not p.finished for p in pa)},
            "b": {"path": b_path, "n": len(rb), "skipped": sum(not p.finished for p in pb)},
            "difference": "B - A", "val_loss": loss, "train_time_s": time,
        }), indent=2))
        return 0
    out = [f"A: {a_path} ({len(ra)} finished, {len(pa) - len(ra)} skipped)"]
    _report_runs(pa, out)
    out.append(f"B: {b_path} ({len(rb)} finished, {len(pb) - len(rb)} skipped)")
    _report_runs(pb, out)
    for name, w, spec in (("final val loss", loss, ".6f"), ("train_time (s)", time, ".3f")):
        lo, hi = w["ci95"]
        out.append(f"{name}: mean A={w['mean_a']:{spec}} mean B={w['mean_b']:{spec}} "
                   f"B - A={w['diff_b_minus_a']:{spec}} 95% CI [{lo:{spec}}, {hi:{spec}}] "
                   f"(Welch df={w['df']:.2f}) t={w['t']:.4f} p (two-sided)={w['p_two_sided']:.4g}")
    print("\n".join(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", metavar="PATH", help="log files or folders of logs")
    parser.add_argument("--group", metavar="G", help="test only experiment G of the PATH set (A, B, ... as listed)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="Welch's t-test of set B against set A")
    parser.add_argument("--values", metavar="FILE|a,b,c",
                        help="test these losses instead of logs: a file (`loss` or `loss time_s` per line) or a,b,c")
    parser.add_argument("--table", action="store_true", help="one row per PATH and experiment")
    parser.add_argument("--published", action="store_true", help="one row per published upstream record")
    parser.add_argument("--time-vs", metavar="SECONDS|NAME|PATH",
                        help="also test that the mean train time is below SECONDS, a published record's "
                             "(x01 ... bulk; or an unmerged claim's: fp8_yarn, bigram, mudd), or the runs in PATH")
    parser.add_argument("--pool", action="store_true", help="test runs of different experiments as one set")
    parser.add_argument("--target", type=float, default=MEDIUM_TARGET, help="val loss the mean must be below")
    parser.add_argument("--alpha", type=float, default=0.01, help="significance level of the claim")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--records-dir", type=Path, default=Path(__file__).resolve().parent,
                        help="where record folders live (for the default PATH)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors exit 2, --help exits 0; return them instead of raising
        return e.code
    modes = [name for name, on in (("PATH ...", args.paths and not args.table), ("--compare", args.compare),
                                   ("--values", args.values), ("--table", args.table),
                                   ("--published", args.published)) if on]
    if len(modes) > 1:
        print(f"error: give only one of PATH ..., --compare A B, --values, --table PATH ..., --published "
              f"(got {', '.join(modes)})", file=sys.stderr)
        return 2
    if args.group and (args.compare or args.values or args.table or args.published or args.pool):
        print("error: --group selects one experiment of PATH ...; it goes with neither --pool nor another mode",
              file=sys.stderr)
        return 2
    if not 0 < args.alpha < 1:
        print(f"error: --alpha {args.alpha}: must be between 0 and 1, e.g. 0.01", file=sys.stderr)
        return 2
    run = (_run_compare if args.compare else _run_values if args.values else _run_table if args.table
           else _run_published if args.published else _run_claim)
    try:
        return run(args)
    except (UnusableInput, runlogs.LogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from tools.cli import run_main
    run_main(main)
