"""Statistics for speedrun records: does a set of runs support the claim, and does an ablation matter?

    python records/stats.py [PATH ...] [--target 2.92] [--alpha 0.01] [--time-vs SECONDS|PATH] [--pool] [--json]
    python records/stats.py --values FILE|a,b,c [--target ...] [--alpha ...] [--time-vs ...] [--json]
    python records/stats.py PATH ... --table [--target ...] [--alpha ...] [--pool] [--json]
    python records/stats.py --compare A B [--pool] [--json]

PATH and A, B are log files or folders of logs (every *.txt in the folder, not recursive).
Without PATH the newest record folder under --records-dir is used (folder names `YYYY-MM-DD`,
`YYYY-MM-DD_Name` or `YYYY-MM-DD-Name`).

Runs are grouped into experiments before any test: the script embedded in the log, the logged
`config` lines (except the fields in NON_EXPERIMENT_FIELDS, e.g. the seed) and the step count.
Logs of more than one experiment are reported group by group and refused as one claim unless
--pool is given. A byte-identical copy of a log counts once.

Exit status:
  0  the claim holds (mean loss below --target with p < --alpha, and, with --time-vs, the mean
     time below the reference with p < --alpha); --compare and --table: the report was printed
  1  the claim does not hold (including: fewer than 2 runs, so no t-test)
  2  unusable input (missing path, no finished run, a bad flag or --values entry), or logs of
     more than one experiment without --pool
"""

import argparse
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import numpy as np
from scipy import stats

SEPARATOR = "=" * 100  # ends the script source at the top of every log, and the versions block after it

# Config fields that do not change what is trained or how it is timed, so runs that differ only in
# them are the same experiment: the seed (runs must differ in it) and where things are written or read
# back. Everything else logged as `config x = y` (including compile, attention, warmup_steps and the
# data paths) separates experiments.
NON_EXPERIMENT_FIELDS = ("seed", "run_id", "log_dir", "device", "dry_run", "save_every", "checkpoint_dir",
                         "resume", "force_resume", "token_bytes_file")

# Targets of the speedrun tracks, for the hint when every run is far from the target given.
KNOWN_TARGETS = {2.92: "GPT-2 Medium track", 3.28: "GPT-2 small (124M) track"}
FAR_FROM_TARGET = 0.1  # every run this far above (or below) the target: probably the wrong --target
POWER_LEVELS = (0.8, 0.9)
MAX_RUNS = 1_000_000  # the power search gives up beyond this many runs
POWER_METHOD = ("noncentral-t power of the one-sided one-sample t-test, with the true mean and std "
                "taken to be the observed ones")
SINGLE_RUN_METHOD = "normal model with the observed mean and std"


class UnusableInput(Exception):
    """Input that gives no answer at all: a missing path, an unreadable file, no finished runs."""


# -----------------------------------------------------------------------------
# Record folder names (diff.py uses these too)

RECORD_NAME = re.compile(r"(\d{4}-\d{2}-\d{2})(?:[_-](.+))?")


def record_name(name: str) -> tuple[str, str] | None:
    """(date, label) of a record folder name `YYYY-MM-DD`, `YYYY-MM-DD_Label` or `YYYY-MM-DD-Label`, else None.

    The label is "" for a bare date; a date that does not exist (2025-13-01) is not a record name.
    """
    m = RECORD_NAME.fullmatch(name)
    if m is None:
        return None
    try:
        date.fromisoformat(m[1])
    except ValueError:
        return None
    return m[1], m[2] or ""


def record_folders(parent: Path) -> list[Path]:
    """The record folders directly in `parent`, oldest first (by date, then label)."""
    found = [(record_name(p.name), p) for p in Path(parent).iterdir() if p.is_dir()]
    return [p for key, p in sorted((k, p) for k, p in found if k is not None)]


def newest_record(records_dir: Path) -> Path:
    """The record folder in `records_dir` that sorts last (date first, then label)."""
    if not Path(records_dir).is_dir():
        raise UnusableInput(f"no such records folder: {records_dir}")
    folders = record_folders(records_dir)
    if not folders:
        raise UnusableInput(f"no record folders (YYYY-MM-DD, YYYY-MM-DD_Name or YYYY-MM-DD-Name) in {records_dir}")
    return folders[-1]


# -----------------------------------------------------------------------------
# Logs: the embedded script, the config lines and the step lines (SPEC section 5)

def embedded_source(text: str) -> str | None:
    """The script at the top of a log: everything before the first line of exactly 100 `=`, or None."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\r\n") == SEPARATOR:
            return "".join(lines[:i])
    return None


def script_digest(source: str) -> str:
    """A short hash of a script's text. Trailing newlines are ignored: the logger adds one to the file's."""
    return hashlib.sha256(source.rstrip("\r\n").encode("utf-8")).hexdigest()[:12]


_CONFIG_LINE = re.compile(r"config (\w+) = (.*)")


def config_lines(text: str) -> dict[str, str]:
    """{field: logged repr} from the `config <field> = <repr>` lines after the embedded script.

    Upstream logs have none: {}. The source above the separator is skipped because it may hold the
    same f-string.
    """
    source = embedded_source(text)
    body = text[len(source):] if source is not None else text
    return {m[1]: m[2] for m in map(_CONFIG_LINE.fullmatch, body.splitlines()) if m}


# The values a step line may carry and the exact formats the trainer prints them in (SPEC section 5).
# train_time and step_avg end every step line, so a line truncated mid-line misses one of them or
# its `ms` unit and is rejected instead of yielding a wrong number. Other `key:value` tokens pass.
_NUMBER = r"\d+(?:\.\d+)?"
_FIELDS = {
    "val_loss": re.compile(_NUMBER),
    "train_time": re.compile(_NUMBER + "ms"),
    "step_avg": re.compile(f"(?:{_NUMBER}|nan)ms"),
}
_STEP = re.compile(r"step:(\d+)/(\d+)")


@dataclass
class RunResult:
    """The outcome of one finished run: its final val loss and its training time (None: not known)."""

    path: Path
    steps: int
    val_loss: float
    train_time_s: float | None
    decimals: int = 6  # digits after the point the loss was printed with (older upstream logs: 4)


@dataclass
class ParsedLog:
    """What one log file gave: a result if the run finished, else the reason it is skipped."""

    path: Path
    result: RunResult | None
    skip_reason: str | None
    warnings: list[str]
    script: str | None = None  # script_digest of the embedded source; None: no separator line
    config: dict[str, str] = field(default_factory=dict)  # the config lines, {} for upstream logs
    content_digest: str = ""  # hash of the whole file, to find copies


def _parse_step_line(line: str) -> tuple[int, int, dict[str, str]] | None:
    """(step, total, {key: value}) of a `step:` line, or None if any part of it is malformed."""
    head, *tokens = line.split()
    m = _STEP.fullmatch(head)
    if m is None:
        return None
    step, total = int(m[1]), int(m[2])
    values = {}
    for token in tokens:
        key, sep, value = token.partition(":")
        if not (key and sep and value) or key in values:
            return None
        if key in _FIELDS and not _FIELDS[key].fullmatch(value):
            return None
        values[key] = value
    if step > total or "train_time" not in values or "step_avg" not in values:
        return None
    return step, total, values


def parse_log(path: Path) -> ParsedLog:
    """Read a training log (ours or upstream's) and find the val line at the final step.

    Only lines that start with `step:` count: the embedded source at the top of a log holds the
    same f-strings, but indented. A `step:` line that does not parse is reported as a warning
    naming the file and line and is otherwise ignored. The embedded script's hash and the config
    lines are kept for grouping runs into experiments.
    Raises UnusableInput if the file cannot be read.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UnusableInput(f"cannot read {path}: {e.strerror or e}") from e
    text = raw.decode("utf-8", errors="replace")
    warnings, last_seen, final, total = [], None, None, None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("step:"):
            continue
        parsed = _parse_step_line(line)
        # a different total step count within one file means it mixes runs or is corrupt
        if parsed is None or (total is not None and parsed[1] != total):
            warnings.append(f"{path}:{lineno}: unparseable step line ignored: {line[:120]!r}")
            continue
        step, total, values = parsed
        last_seen = f"{step}/{total}"
        if "val_loss" in values and step == total:
            loss = values["val_loss"]
            final = RunResult(path, total, float(loss), float(values["train_time"][:-2]) / 1000.0,
                              decimals=len(loss.partition(".")[2]))
    source = embedded_source(text)
    script = script_digest(source) if source is not None else None
    extra = dict(script=script, config=config_lines(text), content_digest=hashlib.sha256(raw).hexdigest())
    if final is not None:
        return ParsedLog(path, final, None, warnings, **extra)
    reason = f"did not finish (last step seen: {last_seen or 'none'}"
    reason += f"; {len(warnings)} unparseable step line(s))" if warnings else ")"
    return ParsedLog(path, None, reason, warnings, **extra)


def collect_logs(paths: list[Path]) -> list[ParsedLog]:
    """Parse every log named by `paths` (files, or folders whose *.txt files are logs)."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            logs = sorted(p.glob("*.txt"))
            if not logs:
                raise UnusableInput(f"no *.txt logs in folder {p}")
            files.extend(logs)
        elif p.is_file():
            files.append(p)
        else:
            raise UnusableInput(f"no such file or folder: {p}")
    unique = {}
    for f in files:
        unique.setdefault(f.resolve(), f)  # a file named twice counts once
    return [parse_log(f) for f in unique.values()]


# -----------------------------------------------------------------------------
# Experiments: which runs may be pooled into one claim

def drop_duplicates(parsed: list[ParsedLog]) -> tuple[list[ParsedLog], list[str]]:
    """(the logs with each byte-identical copy removed, one warning per copy naming both files)."""
    first, kept, warnings = {}, [], []
    for p in parsed:
        original = first.setdefault(p.content_digest, p)
        if original is p:
            kept.append(p)
        else:
            warnings.append(f"{original.path} and {p.path} are byte-identical copies of one log: "
                            f"counted once (as {original.path})")
    return kept, warnings


def experiment_key(log: ParsedLog) -> tuple:
    """What makes runs the same experiment: script hash, config without NON_EXPERIMENT_FIELDS, step count."""
    config = tuple(sorted((k, v) for k, v in log.config.items() if k not in NON_EXPERIMENT_FIELDS))
    return log.script, config, log.result.steps


@dataclass
class Experiment:
    """The finished runs of one experiment, and what sets it apart from the others in the same input."""

    name: str  # "A", "B", ... in order of the first run's file name
    logs: list[ParsedLog]
    distinct: dict[str, str]  # the key parts that differ between experiments: {"script": ..., "steps": ..., field: value}

    @property
    def runs(self) -> list[RunResult]:
        return [p.result for p in self.logs]

    def describe_key(self) -> str:
        """One line: script hash, steps, and the config fields that set this group apart."""
        log = self.logs[0]
        parts = [f"script {log.script or 'unknown (no line of 100 =)'}", f"{log.result.steps} steps"]
        config = {k: v for k, v in self.distinct.items() if k not in ("script", "steps")}
        if not log.config:
            parts.append("no config lines (upstream log format)")
        elif config:
            parts.append("config " + " ".join(f"{k}={v}" for k, v in config.items()))
        else:
            parts.append("same config (seed and fields that do not change training aside)")
        return ", ".join(parts)


def group_runs(finished: list[ParsedLog]) -> list[Experiment]:
    """Group finished runs into experiments (experiment_key), naming each group and what sets it apart."""
    groups: dict[tuple, list[ParsedLog]] = {}
    for log in sorted(finished, key=lambda p: str(p.path)):
        groups.setdefault(experiment_key(log), []).append(log)
    keys = list(groups)
    differing = {}
    if len({k[0] for k in keys}) > 1:
        differing["script"] = lambda k: str(k[0])
    if len({k[2] for k in keys}) > 1:
        differing["steps"] = lambda k: str(k[2])
    configs = [dict(k[1]) for k in keys]
    for name in sorted({n for c in configs for n in c}):
        if len({c.get(name) for c in configs}) > 1:
            differing[name] = lambda k, name=name: dict(k[1]).get(name, "(not logged)")
    return [Experiment(_group_name(i), groups[k], {name: get(k) for name, get in differing.items()})
            for i, k in enumerate(keys)]


def _group_name(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"G{i + 1}"


def set_warnings(runs: list[RunResult], logs: list[ParsedLog] = ()) -> list[str]:
    """Warnings about one set of runs: losses rounded to 4 decimals, 4- and 6-decimal runs mixed, repeated seeds."""
    out = []
    coarse = [r for r in runs if r.decimals < 6]
    if coarse:
        names = ", ".join(str(r.path) for r in coarse[:3]) + (", ..." if len(coarse) > 3 else "")
        out.append(f"{len(coarse)} of {len(runs)} run(s) give the loss with only {min(r.decimals for r in coarse)} "
                   f"decimals ({names}): each loss is rounded by up to half a unit in the last digit, "
                   "so p and the bound are approximate")
        if len(coarse) < len(runs):
            out.append(f"this set mixes {len(coarse)} coarse-decimal loss(es) with {len(runs) - len(coarse)} "
                       "6-decimal one(s): were they printed by different scripts?")
    seeds: dict[str, list[str]] = {}
    for log in logs:
        if "seed" in log.config:
            seeds.setdefault(log.config["seed"], []).append(str(log.path))
    for seed, paths in seeds.items():
        if len(paths) > 1:
            out.append(f"runs {', '.join(paths)} share seed {seed}: not independent runs (give each run a fresh seed)")
    return out


@dataclass
class RunSet:
    """The runs read from some paths: every log (copies removed), its experiments, and what to warn about."""

    label: str
    parsed: list[ParsedLog]
    groups: list[Experiment]
    warnings: list[str]
    duplicates: list[str]


def load_runs(paths: list[Path], label: str | None = None) -> RunSet:
    """Read, de-duplicate and group the logs at `paths`. Raises UnusableInput if no run finished."""
    label = label or ", ".join(map(str, paths))
    parsed = collect_logs(paths)
    parsed, duplicates = drop_duplicates(parsed)
    finished = [p for p in parsed if p.result is not None]
    if not finished:
        raise UnusableInput(f"no finished runs in {label}")
    warnings = [w for p in parsed for w in p.warnings] + duplicates
    return RunSet(label, parsed, group_runs(finished), warnings, duplicates)


def pooled_or_refused(rs: RunSet, pool: bool, what: str = "claim") -> tuple[list[ParsedLog], str | None]:
    """(the runs to test as one set, None) or (all runs, the refusal message) when `rs` mixes experiments."""
    logs = [p for g in rs.groups for p in g.logs]
    if len(rs.groups) == 1:
        return logs, None
    names = ", ".join(g.name for g in rs.groups)
    if pool:
        rs.warnings.append(f"--pool: {len(rs.groups)} experiments (groups {names}) tested as one {what}")
        return logs, None
    return logs, (f"{rs.label} holds {len(rs.groups)} experiments (groups {names}: different scripts, configs "
                  f"or step counts); split the folder or pass --pool to test them as one {what}")


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
    if n < 2:
        return {**none, "note": f"n = {n}: no sample std, so no t-test; a t-test needs at least 2 runs"}
    std = _spread(losses)
    if std is None:
        return {**none, "note": f"all {n} losses are equal: no spread, so no t-test "
                                "(copies of one log, or runs with the same seed?)"}
    res = stats.ttest_1samp(losses, target, alternative="less")
    mean, sem = float(np.mean(losses)), std / math.sqrt(n)
    return {"t": float(res.statistic), "p": float(res.pvalue), "df": n - 1,
            "upper_bound": mean + float(stats.t.ppf(1 - alpha, n - 1)) * sem, "upper_bound_level": 1 - alpha,
            "upper_bound_95": mean + float(stats.t.ppf(0.95, n - 1)) * sem,
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
    """Welch's two-sample t-test of B against A: means, B - A, its 95% CI (Welch-Satterthwaite df), two-sided p."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    diff = b.mean() - a.mean()
    with np.errstate(divide="ignore", invalid="ignore"):  # identical runs: se = 0, df undefined
        se = np.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
        half = stats.t.ppf(0.975, df) * se
    res = stats.ttest_ind(b, a, equal_var=False)
    return {"mean_a": float(a.mean()), "mean_b": float(b.mean()), "diff_b_minus_a": float(diff),
            "ci95": [float(diff - half), float(diff + half)], "df": float(df), "se": float(se),
            "t": float(res.statistic), "p_two_sided": float(res.pvalue)}


def paired_test(a: list[float], b: list[float]) -> dict:
    """Paired t-test of B against A (a[i] and b[i] share seed i): mean of B - A, its 95% CI, t, two-sided p.

    The same test as scipy.stats.ttest_rel(b, a). Pairing removes what the two runs of one seed
    have in common (the initial values of the tensors they share), so it can see smaller deltas than
    Welch's test. Fewer than 2 pairs, or deltas that are all equal, give nan where undefined.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired_test needs two equally long lists, got {a.shape} and {b.shape}")
    deltas, n = b - a, len(a)
    mean = float(deltas.mean()) if n else math.nan
    if n < 2:
        return {"n": n, "mean_diff": mean, "ci95": [math.nan, math.nan], "df": n - 1,
                "t": math.nan, "p_two_sided": math.nan}
    with np.errstate(divide="ignore", invalid="ignore"):  # all deltas equal: se = 0
        half = stats.t.ppf(0.975, n - 1) * deltas.std(ddof=1) / math.sqrt(n)
        res = stats.ttest_rel(b, a)
    return {"n": n, "mean_diff": mean, "ci95": [float(mean - half), float(mean + half)], "df": n - 1,
            "t": float(res.statistic), "p_two_sided": float(res.pvalue)}


@dataclass
class TimeReference:
    """What --time-vs compares the training times with: a number of seconds, or the runs of another set."""

    label: str
    seconds: float | None = None
    times: list[float] | None = None


def time_test(times: list[float], ref: TimeReference, alpha: float) -> dict:
    """One-sided test that the mean training time is below the reference, at level alpha.

    Against a number: one-sample t-test (H1: mean < seconds) and the one-sided 1 - alpha upper bound of
    the mean. Against other runs: Welch's test (H1: mean < their mean) and the one-sided 1 - alpha upper
    bound of (mean - their mean).
    """
    base = {"reference": ref.label, "level": 1 - alpha, "t": None, "p": None, "df": None, "holds": False}
    if len(times) < 2:
        return {**base, "method": None, "note": "a time test needs at least 2 runs with a train time"}
    if ref.seconds is not None:
        std = _spread(times)
        if std is None:
            return {**base, "method": None, "note": "all train times are equal: no spread, no t-test"}
        res = stats.ttest_1samp(times, ref.seconds, alternative="less")
        mean = float(np.mean(times))
        return {**base, "method": "one-sample t-test, H1: mean < reference", "mean": mean,
                "upper_bound": mean + float(stats.t.ppf(1 - alpha, len(times) - 1)) * std / math.sqrt(len(times)),
                "t": float(res.statistic), "p": float(res.pvalue), "df": len(times) - 1,
                "holds": bool(res.pvalue < alpha), "note": None}
    w = welch(ref.times, times)
    if not (w["se"] > 0 and math.isfinite(w["df"])):
        return {**base, "method": None, "note": "no spread in either set of train times: no Welch test"}
    p = float(stats.t.cdf(w["t"], w["df"]))
    return {**base, "method": "Welch's t-test, H1: mean < reference runs' mean", "mean": w["mean_b"],
            "reference_mean": w["mean_a"], "reference_n": len(ref.times), "diff": w["diff_b_minus_a"],
            "upper_bound": w["diff_b_minus_a"] + float(stats.t.ppf(1 - alpha, w["df"])) * w["se"],
            "t": w["t"], "p": p, "df": w["df"], "holds": bool(p < alpha), "note": None}


def target_hint(losses: list[float], target: float) -> str | None:
    """A hint when every run is FAR_FROM_TARGET or more above (or below) the target: probably the wrong --target."""
    lo, hi, mean = min(losses), max(losses), float(np.mean(losses))
    if lo <= target + FAR_FROM_TARGET and hi >= target - FAR_FROM_TARGET:
        return None
    where = "above" if lo > target else "below"
    near = [t for t in KNOWN_TARGETS if t != target and abs(mean - t) < FAR_FROM_TARGET]
    if near:
        t = min(near, key=lambda t: abs(mean - t))
        return f"every run is far {where} the target {target}; did you mean --target={t} ({KNOWN_TARGETS[t]})?"
    return f"every run is far {where} the target {target}; did you mean another --target?"


def analyse(losses: list[float], times: list[float | None], target: float, alpha: float,
            time_vs: TimeReference | None = None) -> dict:
    """Every figure of the claim check for one set of runs; `holds` is the overall verdict."""
    known_times = [t for t in times if t is not None]
    out = {"val_loss": describe(losses), "t_test": claim_test(losses, target, alpha),
           "power": power_estimate(losses, target, alpha), "single_run_below": single_run_chance(losses, target),
           "train_time_s": describe(known_times) if known_times else None, "time_vs": None,
           "hint": target_hint(losses, target)}
    if time_vs is not None:
        out["time_vs"] = time_test(known_times, time_vs, alpha)
    out["holds"] = out["t_test"]["holds"] and (out["time_vs"] is None or out["time_vs"]["holds"])
    out["verdict"] = "claim holds" if out["holds"] else "claim does not hold"
    return out


# -----------------------------------------------------------------------------
# Text report

def _json_safe(obj):
    """obj with nan and infinities replaced by None, which strict JSON can carry."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _describe_line(name: str, d: dict, spec: str) -> str:
    std = "n/a" if d["std"] is None else format(d["std"], spec)
    return (f"{name}: n={d['n']} mean={d['mean']:{spec}} std={std} "
            f"median={d['median']:{spec}} min={d['min']:{spec}} max={d['max']:{spec}}")


def _report_runs(parsed: list[ParsedLog], out: list[str]) -> None:
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


def _time_vs_line(tv: dict) -> list[str]:
    level = f"{100 * tv['level']:.10g}%"
    if tv["note"]:
        return [f"time vs {tv['reference']}: not tested: {tv['note']}"]
    if "reference_mean" in tv:
        head = (f"time vs {tv['reference']} (Welch one-sided, H1: mean < {tv['reference_mean']:.3f}s, "
                f"the mean of its {tv['reference_n']} runs): difference={tv['diff']:.3f}s "
                f"{level} upper bound of difference={tv['upper_bound']:.3f}s")
    else:
        head = (f"time vs {tv['reference']} (one-sample t, H1: mean < {tv['reference']}): "
                f"{level} upper bound of mean={tv['upper_bound']:.3f}s")
    return [f"{head} t={tv['t']:.4f} p={tv['p']:.4g}",
            f"time verdict: {'faster' if tv['holds'] else 'not shown to be faster'}"]


def analysis_lines(a: dict, target: float, alpha: float) -> list[str]:
    """The text report of analyse()'s result, one figure per line."""
    loss, test, n = a["val_loss"], a["t_test"], a["val_loss"]["n"]
    out = [_describe_line("final val loss", loss, ".6f")]
    if test["note"]:
        out.append(f"t-test against {target} not possible: {test['note']}")
    else:
        out.append(f"one-sided t-test against {target} (H1: mean < {target}): t={test['t']:.4f} p={test['p']:.4g} "
                   f"{level_label(alpha)} upper bound of mean={test['upper_bound']:.6f}")
        if alpha != 0.05:  # SPEC §6 reports the 95% bound whatever alpha the claim uses
            out.append(f"one-sided 95% upper bound of mean (the SPEC's figure)={test['upper_bound_95']:.6f}")
    if a["hint"]:
        out.append(f"hint: {a['hint']}")
    out.append(_power_line(a["power"], n, alpha))
    below = a["single_run_below"]
    if below["p"] is not None:
        out.append(f"chance that one run lands below {target}: {below['p']:.3f} ({below['method']})")
    if a["train_time_s"]:
        out.append(_describe_line("train_time (s)", a["train_time_s"], ".3f"))
    if a["time_vs"]:
        out.extend(_time_vs_line(a["time_vs"]))
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

def _analyse_logs(logs: list[ParsedLog], args, time_vs: TimeReference | None) -> tuple[dict, list[str]]:
    runs = [p.result for p in logs]
    a = analyse([r.val_loss for r in runs], [r.train_time_s for r in runs], args.target, args.alpha, time_vs)
    return a, set_warnings(runs, logs)


def time_reference(spec: str | None, pool: bool) -> TimeReference | None:
    """--time-vs: a number of seconds, or a log file / folder whose runs' train times are the reference."""
    if spec is None:
        return None
    try:
        seconds = float(spec)
    except ValueError:
        seconds = None
    if seconds is not None:
        if not (math.isfinite(seconds) and seconds > 0):
            raise UnusableInput(f"--time-vs {spec}: give a positive number of seconds or a log folder")
        return TimeReference(f"{seconds:g}s", seconds=seconds)
    if not Path(spec).exists():
        raise UnusableInput(f"--time-vs {spec}: neither a number of seconds nor an existing log file or folder")
    rs = load_runs([Path(spec)])
    logs, refusal = pooled_or_refused(rs, pool, "reference")
    if refusal:
        raise UnusableInput(f"--time-vs: {refusal}")
    _print_warnings(rs.warnings)
    times = [p.result.train_time_s for p in logs]
    if len(times) < 2:
        raise UnusableInput(f"--time-vs {spec}: Welch's test needs at least 2 finished reference runs, found {len(times)}")
    return TimeReference(spec, times=times)


def _run_claim(args) -> int:
    paths = args.paths or [newest_record(args.records_dir)]
    rs = load_runs(paths)
    time_vs = time_reference(args.time_vs, args.pool)
    logs, refusal = pooled_or_refused(rs, args.pool)
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
        payload = {"paths": [str(p) for p in paths], "target": args.target, "alpha": args.alpha,
                   "runs": [_run_json(r, g.name) for g in rs.groups for r in g.runs],
                   "skipped": [{"path": str(p.path), "reason": p.skip_reason} for p in rs.parsed if p.result is None],
                   "warnings": warnings, "duplicates": rs.duplicates, "groups": groups,
                   "pooled": len(rs.groups) > 1 and args.pool, "refused": refusal}
        claim_keys = ("val_loss", "t_test", "power", "single_run_below", "train_time_s", "time_vs", "hint")
        payload.update({k: claim[k] if claim else None for k in claim_keys})
        payload["verdict"] = claim["verdict"] if claim else "refused"
        print(json.dumps(_json_safe(payload), indent=2))
    else:
        _print_warnings(warnings)
        finished = sum(len(g.runs) for g in rs.groups)
        out = [f"logs: {', '.join(map(str, paths))}", f"{finished} finished run(s), {len(rs.parsed) - finished} skipped"]
        if len(rs.groups) == 1:
            _report_runs(rs.parsed, out)
            out.append(f"experiment: {rs.groups[0].describe_key()}")
        else:
            _report_runs([p for p in rs.parsed if p.result is None], out)
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
    return 0 if claim["holds"] else 1


def parse_values(spec: str) -> list[RunResult]:
    """--values: a file with one `loss` or `loss time_s` per line (blank lines and # comments skipped),
    or a comma-separated list of losses. Raises UnusableInput naming the file and line of a bad entry."""
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
    warnings = set_warnings(runs)
    if args.json:
        print(json.dumps(_json_safe({"values": args.values, "target": args.target, "alpha": args.alpha,
                                     "runs": [_run_json(r) for r in runs], "warnings": warnings, **claim}), indent=2))
    else:
        _print_warnings(warnings)
        print("\n".join([f"values: {args.values} ({len(runs)} run(s))"]
                        + analysis_lines(claim, args.target, args.alpha)))
    return 0 if claim["holds"] else 1


def table_rows(args, time_vs: TimeReference | None) -> list[dict]:
    """One row per PATH and experiment (per PATH with --pool); an unusable PATH gives a row with its error.

    A folder without logs that is not named like a record folder is left out.
    """
    rows = []
    for path in args.paths:
        if Path(path).is_dir() and record_name(Path(path).name) is None and not any(Path(path).glob("*.txt")):
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
    verdict = ("holds" if row["holds"] else "does not hold") if test["p"] is not None else "no t-test"
    time_p = [num(row["time_vs"]["p"], ".3g")] if with_time_test else []
    return ([label, str(loss["n"]), num(loss["mean"], ".6f"), num(loss["std"], ".6f"), num(test["p"], ".3g"),
             num(test["upper_bound"], ".6f"), num(time["mean"] if time else None, ".3f")] + time_p + [verdict])


def _run_table(args) -> int:
    if not args.paths:
        raise UnusableInput("--table needs the folders to tabulate, e.g. records/*/")
    time_vs = time_reference(args.time_vs, args.pool)
    rows = table_rows(args, time_vs)
    if args.json:
        print(json.dumps(_json_safe({"target": args.target, "alpha": args.alpha, "rows": rows}), indent=2))
    else:
        _print_warnings([f"{r['path']}: {w}" for r in rows for w in r.get("warnings") or ()])
        cells = [_table_cells(r, args.alpha, time_vs is not None) for r in [None] + rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
        print(f"target {args.target}, alpha {args.alpha}" + (f", time vs {time_vs.label}" if time_vs else ""))
        for c in cells:
            print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
    return 2 if not rows or all(r["error"] for r in rows) else 0


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
        print(json.dumps(_json_safe({
            "a": {"path": a_path, "n": len(ra), "skipped": sum(p.result is None for p in pa)},
            "b": {"path": b_path, "n": len(rb), "skipped": sum(p.result is None for p in pb)},
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
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="Welch's t-test of set B against set A")
    parser.add_argument("--values", metavar="FILE|a,b,c",
                        help="test these losses instead of logs: a file (`loss` or `loss time_s` per line) or a,b,c")
    parser.add_argument("--table", action="store_true", help="one row per PATH and experiment")
    parser.add_argument("--time-vs", metavar="SECONDS|PATH",
                        help="also test that the mean train time is below SECONDS, or below the runs in PATH")
    parser.add_argument("--pool", action="store_true", help="test runs of different experiments as one set")
    parser.add_argument("--target", type=float, default=2.92, help="val loss the mean must be below")
    parser.add_argument("--alpha", type=float, default=0.01, help="significance level of the claim")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--records-dir", type=Path, default=Path(__file__).resolve().parent,
                        help="where record folders live (for the default PATH)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors exit 2, --help exits 0; return them instead of raising
        return e.code
    modes = [name for name, on in (("PATH ...", args.paths and not args.table), ("--compare", args.compare),
                                   ("--values", args.values), ("--table", args.table)) if on]
    if len(modes) > 1:
        print(f"error: give only one of PATH ..., --compare A B, --values, --table PATH ... (got {', '.join(modes)})",
              file=sys.stderr)
        return 2
    if not 0 < args.alpha < 1:
        print(f"error: --alpha {args.alpha}: must be between 0 and 1, e.g. 0.01", file=sys.stderr)
        return 2
    run = _run_compare if args.compare else _run_values if args.values else _run_table if args.table else _run_claim
    try:
        return run(args)
    except UnusableInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
