"""Statistics for speedrun records: does a set of runs support the claim, and does an ablation matter?

    python records/stats.py [PATH ...] [--target 2.92] [--alpha 0.01] [--json] [--records-dir DIR]
    python records/stats.py --compare A B [--json]

PATH and A, B are log files or folders of logs (every *.txt in the folder, not recursive).
Without PATH the newest record folder `<records-dir>/<YYYY-MM-DD>_<Name>/` is used.
Exit status: 0 the claim holds (or the comparison ran), 1 it does not, 2 unusable input.
"""

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

RECORD_FOLDER = re.compile(r"\d{4}-\d{2}-\d{2}_.+")

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


class UnusableInput(Exception):
    """Input that gives no answer at all: a missing path, an unreadable file, no finished runs."""


@dataclass
class RunResult:
    """The outcome of one finished run: its final val loss and its training time."""

    path: Path
    steps: int
    val_loss: float
    train_time_s: float


@dataclass
class ParsedLog:
    """What one log file gave: a result if the run finished, else the reason it is skipped."""

    path: Path
    result: RunResult | None
    skip_reason: str | None
    warnings: list[str]


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
    naming the file and line and is otherwise ignored.
    Raises UnusableInput if the file cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UnusableInput(f"cannot read {path}: {e.strerror or e}") from e
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
            final = RunResult(path, total, float(values["val_loss"]), float(values["train_time"][:-2]) / 1000.0)
    if final is not None:
        return ParsedLog(path, final, None, warnings)
    reason = f"did not finish (last step seen: {last_seen or 'none'}"
    reason += f"; {len(warnings)} unparseable step line(s))" if warnings else ")"
    return ParsedLog(path, None, reason, warnings)


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


def newest_record(records_dir: Path) -> Path:
    """The record folder `<YYYY-MM-DD>_<Name>` that sorts last (date first, then name)."""
    if not Path(records_dir).is_dir():
        raise UnusableInput(f"no such records folder: {records_dir}")
    folders = sorted(p for p in Path(records_dir).iterdir() if p.is_dir() and RECORD_FOLDER.fullmatch(p.name))
    if not folders:
        raise UnusableInput(f"no record folders <YYYY-MM-DD>_<Name> in {records_dir}")
    return folders[-1]


def _json_safe(obj):
    """obj with nan and infinities replaced by None, which strict JSON can carry."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


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


def claim_test(losses: list[float], target: float, alpha: float) -> dict:
    """One-sided one-sample t-test, H1: mean < target, plus the one-sided 95% upper bound of the mean.

    With a single run there is no variance estimate, so no test: the claim does not hold.
    """
    n = len(losses)
    if n < 2:
        return {"t": None, "p": None, "upper_bound_95": None, "holds": False,
                "note": f"n = {n}: no sample std, so no t-test; a claim needs at least 2 runs"}
    res = stats.ttest_1samp(losses, target, alternative="less")
    sem = np.std(losses, ddof=1) / math.sqrt(n)
    upper = np.mean(losses) + stats.t.ppf(0.95, n - 1) * sem
    return {"t": float(res.statistic), "p": float(res.pvalue), "upper_bound_95": float(upper),
            "holds": bool(res.pvalue < alpha), "note": None}


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
            "ci95": [float(diff - half), float(diff + half)], "df": float(df),
            "t": float(res.statistic), "p_two_sided": float(res.pvalue)}


def _describe_line(name: str, d: dict, spec: str) -> str:
    std = "n/a" if d["std"] is None else format(d["std"], spec)
    return (f"{name}: n={d['n']} mean={d['mean']:{spec}} std={std} "
            f"median={d['median']:{spec}} min={d['min']:{spec}} max={d['max']:{spec}}")


def _finished(parsed: list[ParsedLog], label: str) -> list[RunResult]:
    """The finished runs, after printing every parse warning to stderr."""
    for w in (w for p in parsed for w in p.warnings):
        print(f"warning: {w}", file=sys.stderr)
    runs = [p.result for p in parsed if p.result is not None]
    if not runs:
        raise UnusableInput(f"no finished runs in {label}")
    return runs


def _report_runs(parsed: list[ParsedLog], out: list[str]) -> None:
    for p in parsed:
        if p.result:
            out.append(f"  run {p.path}: val_loss={p.result.val_loss:.6f} train_time={p.result.train_time_s:.3f}s")
        else:
            out.append(f"  skipped {p.path}: {p.skip_reason}")


def _run_claim(args) -> int:
    paths = args.paths or [newest_record(args.records_dir)]
    parsed = collect_logs(paths)
    runs = _finished(parsed, ", ".join(map(str, paths)))
    losses = [r.val_loss for r in runs]
    loss, time = describe(losses), describe([r.train_time_s for r in runs])
    test = claim_test(losses, args.target, args.alpha)
    verdict = "claim holds" if test["holds"] else "claim does not hold"
    if args.json:
        print(json.dumps(_json_safe({
            "paths": [str(p) for p in paths], "target": args.target, "alpha": args.alpha,
            "runs": [{"path": str(r.path), "steps": r.steps, "val_loss": r.val_loss,
                      "train_time_s": r.train_time_s} for r in runs],
            "skipped": [{"path": str(p.path), "reason": p.skip_reason} for p in parsed if p.result is None],
            "warnings": [w for p in parsed for w in p.warnings],
            "val_loss": loss, "t_test": test, "verdict": verdict, "train_time_s": time,
        }), indent=2))
    else:
        out = [f"logs: {', '.join(map(str, paths))}",
               f"{len(runs)} finished run(s), {len(parsed) - len(runs)} skipped"]
        _report_runs(parsed, out)
        out.append(_describe_line("final val loss", loss, ".6f"))
        if test["note"]:
            out.append(f"t-test against {args.target} not possible: {test['note']}")
        else:
            out.append(f"one-sided t-test against {args.target} (H1: mean < {args.target}): "
                       f"t={test['t']:.4f} p={test['p']:.4g} 95% upper bound of mean={test['upper_bound_95']:.6f}")
        out.append(f"verdict at alpha={args.alpha}: {verdict}")
        out.append(_describe_line("train_time (s)", time, ".3f"))
        print("\n".join(out))
    return 0 if test["holds"] else 1


def _run_compare(args) -> int:
    a_path, b_path = args.compare
    sets = []
    for path in (a_path, b_path):
        parsed = collect_logs([path])
        runs = _finished(parsed, path)
        if len(runs) < 2:
            raise UnusableInput(f"{path}: Welch's test needs at least 2 finished runs per set, found {len(runs)}")
        sets.append((parsed, runs))
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
    """Command-line entry point; returns the exit status (0 holds / compared, 1 does not hold, 2 unusable)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", metavar="PATH", help="log files or folders of logs")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="Welch's t-test of set B against set A")
    parser.add_argument("--target", type=float, default=2.92, help="val loss the mean must be below")
    parser.add_argument("--alpha", type=float, default=0.01, help="significance level of the claim")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--records-dir", type=Path, default=Path(__file__).resolve().parent,
                        help="where record folders live (for the default PATH)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors exit 2, --help exits 0; return them instead of raising
        return e.code
    if args.compare and args.paths:
        print("error: give either PATH ... or --compare A B, not both", file=sys.stderr)
        return 2
    try:
        return _run_compare(args) if args.compare else _run_claim(args)
    except UnusableInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
