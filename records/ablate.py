"""Seed-matched ablations: run a grid of trainer configurations x seeds, then compare the arms.

    python records/ablate.py --preset tiny --grid lore_input=false,true --grid lore_output=false,true \\
        --seeds 1,2,3 [--launcher "./run.sh"] [--out DIR] [--baseline ARM] \\
        [--band-loss 0.002] [--band-time 1.05] [--band-metric loss|bpb] [--dry_run] [-- extra trainer flags]
    python records/ablate.py --report-only --out DIR [--baseline ARM] [--band-loss X] [--band-time R]

An arm is one combination of the --grid values (the grid is their product, in the order given).
--grid FIELD=V1,V2 splits on commas; values that hold commas themselves (value_embed_layout) are
separated by semicolons instead: --grid 'value_embed_layout=0,1,2,...;0,0,1,...'.
Runs go seed-major (every arm of seed 1, then every arm of seed 2, ...; each seed's block starts
one arm later than the one before), so drift of the machine hits all arms alike. Every arm of a
seed gets the same --seed: the trainer derives each parameter's init from the seed and the
parameter's name, so the tensors two arms share start identical.
Each run is one launcher call logging to <out>/logs/<arm>/seed<S>/ (with stdout.log, stderr.log
and run.json beside the log). Runs whose folder already holds a finished log of the same
experiment and seed are skipped, so rerunning an interrupted sweep completes only what is
missing; each finished log is read once (records/runlogs.py caches it). Results: <out>/runs.csv,
<out>/report.md and <out>/report.json (the same statistics at full precision).
Stopping the sweep (Ctrl-C, SIGTERM, even SIGKILL on Linux) stops the run it was making.
Exit status: 0 all runs finished (or --dry_run, --report-only), 1 some run failed, 2 unusable input,
130 / 143 interrupted by SIGINT / SIGTERM.
"""

import argparse
import csv
import ctypes
import dataclasses
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository root instead of records/ on the path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
import tqdm  # noqa: E402

from records import runlogs, stats  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LAUNCHER = str(REPO / "run.sh")
# Trainer modes that make a run something else than a fresh training run; no arm or extra flag may set them.
NOT_TRAINING = ("dry_run", "resume", "bench_steps")
QUALITY = {"loss": "val_loss", "bpb": "val_bpb"}
COMPARED = ("val_loss", "val_bpb", "train_time_s")  # metrics with paired and Welch tests in the report


class SweepError(Exception):
    """Input the sweep cannot use: a bad grid, flag or output folder. Nothing has run yet."""


# -----------------------------------------------------------------------------
# The sweep: arms, seeds and the runs they make

@dataclass(frozen=True)
class Arm:
    """One configuration of the grid: (field, value text) pairs in grid order."""

    settings: tuple

    @property
    def name(self) -> str:
        """Folder-safe name, e.g. lore_input-true__lore_output-false ('default' for an empty grid)."""
        parts = [f"{f}-{re.sub(r'[^A-Za-z0-9._-]', '_', v)}" for f, v in self.settings]
        return "__".join(parts) or "default"

    @property
    def label(self) -> str:
        return " ".join(f"{f}={v}" for f, v in self.settings) or "default"

    @property
    def flags(self) -> list[str]:
        return [f"--{f}={v}" for f, v in self.settings]


@dataclass
class Sweep:
    """What a sweep runs (saved as <out>/sweep.json, which --report-only reads back)."""

    preset: str
    grid: list  # [[field, [value, ...]], ...]
    seeds: list
    extra: list = field(default_factory=list)
    launcher: str = DEFAULT_LAUNCHER
    baseline: str | None = None
    band_loss: float | None = None
    band_time: float | None = None
    band_metric: str = "loss"

    def arms(self) -> list[Arm]:
        fields_ = [f for f, _ in self.grid]
        return [Arm(tuple(zip(fields_, combo))) for combo in itertools.product(*(v for _, v in self.grid))]

    def baseline_arm(self) -> Arm:
        """The --baseline arm (by name or label), else the first arm."""
        arms = self.arms()
        if self.baseline is None:
            return arms[0]
        for arm in arms:
            if self.baseline in (arm.name, arm.label):
                return arm
        raise SweepError(f"--baseline {self.baseline!r} is not an arm; arms: {', '.join(a.name for a in arms)}")


@dataclass(frozen=True)
class Run:
    arm: Arm
    seed: int
    folder: Path

    @property
    def run_id(self) -> str:
        return f"{self.arm.name}_s{self.seed}"


def plan(sweep: Sweep, out: Path) -> list[Run]:
    """Every run in launch order: seed-major; the k-th seed starts at the k-th arm (arms rotated), so
    no arm always runs first in its block, where a slower or faster machine state would bias it."""
    arms = sweep.arms()
    return [Run(arm, seed, out / "logs" / arm.name / f"seed{seed}")
            for k, seed in enumerate(sweep.seeds) for arm in arms[k % len(arms):] + arms[:k % len(arms)]]


def trainer_flags(sweep: Sweep, run: Run) -> list[str]:
    return [f"--preset={sweep.preset}", *run.arm.flags, f"--seed={run.seed}", f"--run_id={run.run_id}",
            f"--log_dir={run.folder}", *sweep.extra]


def command(sweep: Sweep, run: Run) -> list[str]:
    return [*shlex.split(sweep.launcher), *trainer_flags(sweep, run)]


def parse_grid(text: str) -> list:
    """'field=v1,v2' (or 'field=v1;v2' when values hold commas) -> [field, [v1, v2]]."""
    name, eq, values = text.partition("=")
    sep = ";" if ";" in values else ","
    items = [v.strip() for v in values.split(sep)]
    if not eq or not name or not all(items):
        raise SweepError(f"--grid {text!r}: write FIELD=VALUE1,VALUE2 (e.g. --grid lore_input=false,true)")
    if len(set(items)) != len(items):
        raise SweepError(f"--grid {text!r}: a value is listed twice")
    return [name, items]


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: expected comma-separated integers, e.g. --seeds 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {text!r}: give at least one seed, each once")
    return seeds


# -----------------------------------------------------------------------------
# Reading a run's log (records/runlogs.py: one parse per log file)

def read_run(path: Path) -> tuple[runlogs.RunLog | None, str | None]:
    """(the log, None) for a finished log, (None, why not) otherwise."""
    try:
        log = runlogs.read_log(path)
    except runlogs.LogError as e:
        return None, str(e)
    return (log, None) if log.finished else (None, log.skip_reason)


# -----------------------------------------------------------------------------
# Run outcomes: finished, failed or not run yet

@dataclass
class Outcome:
    run: Run
    status: str  # finished | failed | not run
    metrics: runlogs.RunLog | None = None
    reason: str = ""


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    return lines[-1].strip() if lines else ""


def inspect(run: Run) -> Outcome:
    """What the run's folder says: the newest finished log wins; else run.json's exit code and stderr."""
    if not run.folder.is_dir():
        return Outcome(run, "not run")
    logs = sorted(run.folder.glob("*.txt"), key=lambda p: p.stat().st_mtime)
    reads = [read_run(p) for p in logs]
    done = [m for m, _ in reads if m is not None]
    if done:
        return Outcome(run, "finished", done[-1])
    record = run.folder / "run.json"
    if not record.exists():
        return Outcome(run, "not run")
    code = json.loads(record.read_text())["exit_code"]
    if code != 0:
        err = last_line(run.folder / "stderr.log")
        return Outcome(run, "failed", reason=f"exit {code}" + (f": {err}" if err else ""))
    why = reads[-1][1] if reads else "no log written"
    return Outcome(run, "failed", reason=f"exit 0 but no finished log ({why})")


class Interrupted(Exception):
    """SIGTERM reached the sweep (SIGINT arrives as KeyboardInterrupt)."""


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal the kernel sends this process when its parent dies


def _die_with_parent():
    """For preexec_fn: on Linux, the child gets SIGTERM when the sweep dies, even by SIGKILL; if the
    sweep died before the child got there, the child leaves at once. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return None
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def setup():
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(143)
    return setup


def _stop(proc: subprocess.Popen) -> None:
    """Ask the child to stop (SIGTERM: torchrun passes it to its workers), then kill it after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch(sweep: Sweep, run: Run) -> Outcome:
    """One launcher call, its output in the run's folder; a rerun first sets unfinished logs aside.
    An interrupt of the sweep while the run goes on stops the run, then propagates."""
    run.folder.mkdir(parents=True, exist_ok=True)
    for old in run.folder.glob("*.txt"):
        if read_run(old)[0] is None:
            old.rename(old.with_name(f"{old.name}.incomplete"))  # kept for a post-mortem, no longer read as a log
    cmd = command(sweep, run)
    start = time.perf_counter()
    with open(run.folder / "stdout.log", "w") as out, open(run.folder / "stderr.log", "w") as err:
        env = {k: v for k, v in os.environ.items() if k != "RUNS"}  # run.sh would repeat the run RUNS times
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, preexec_fn=_die_with_parent())
        try:
            code = proc.wait()
        except BaseException:
            _stop(proc)
            raise
    record = dict(command=cmd, exit_code=code, wall_s=round(time.perf_counter() - start, 3),
                  finished_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    (run.folder / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return inspect(run)


# -----------------------------------------------------------------------------
# Checks before anything runs

def flag_name(flag: str) -> str:
    return flag.lstrip("-").partition("=")[0]


def sweep_set_fields(sweep: Sweep) -> set[str]:
    """The fields the sweep passes to every run itself (preset, seed, run id, log folder)."""
    probe = Sweep(sweep.preset, [], [0])
    return {flag_name(f) for f in trainer_flags(probe, plan(probe, Path("."))[0])}


def check_out(out: Path) -> None:
    """--out must be a folder, or a path where one can be made: SweepError otherwise. Writes nothing."""
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {out}: is a file, not a folder; give a folder (it is made if missing)")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise SweepError(f"--out {out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SweepError(f"--out {out}: cannot write in {parent} (permission denied); choose another --out")


def check_sweep_flags(sweep: Sweep, out: Path) -> None:
    """The checks that need no trainer: fields set twice or owned by the sweep, arm names, the
    baseline, the launcher, the output folder. Raises SweepError naming the problem."""
    own = sweep_set_fields(sweep)
    for name, _ in sweep.grid:
        if name in own:
            raise SweepError(f"--grid {name}=...: the sweep sets --{name} itself; it cannot be an arm setting")
        if name in NOT_TRAINING:
            raise SweepError(f"--grid {name}=...: the runs of a sweep train from scratch; --{name} cannot be an arm setting")
    if len({name for name, _ in sweep.grid}) != len(sweep.grid):
        raise SweepError("--grid: a field is given twice; put all its values in one --grid FIELD=V1,V2")
    for flag in sweep.extra:
        if flag_name(flag) in own | set(NOT_TRAINING):
            raise SweepError(f"extra trainer flag {flag!r}: the sweep sets it itself or cannot use it "
                             "(use --preset / --seeds / --out)")
    sweep.baseline_arm()
    if len({a.name for a in sweep.arms()}) != len(sweep.arms()):
        raise SweepError("--grid: two arms map to the same folder name; use values that differ in letters or digits")
    launcher = shlex.split(sweep.launcher)
    if not launcher or shutil.which(launcher[0]) is None:
        raise SweepError(f"--launcher {sweep.launcher!r}: {launcher[0] if launcher else 'nothing'} is not an executable")
    check_out(out)


def expected_log(tg, config) -> runlogs.RunLog:
    """The config lines (and field groups) the trainer would log for `config`, read back by records/runlogs.py,
    so that arms and finished logs are compared by the same rule as everything else."""
    return runlogs.parse_text("\n".join(tg.config_lines(config)))


def check_sweep(sweep: Sweep, out: Path) -> None:
    """check_sweep_flags, then with the trainer: every arm a valid trainer config, arms that are
    different experiments, and no finished log in `out` of another experiment or seed than its
    run asks for. Raises SweepError naming the problem."""
    check_sweep_flags(sweep, out)
    sys.path.insert(0, str(REPO))
    import train_gpt_medium as tg  # imports torch: after every check that does not need it

    known = {f.name for f in dataclasses.fields(tg.Hyperparameters)}
    for name, _ in sweep.grid:
        if name not in known:
            raise SweepError(f"--grid {name}=...: unknown field {name!r} (fields of the trainer's Hyperparameters)")
    experiments = {}
    for run in plan(sweep, out)[:len(sweep.arms())]:  # the first seed's block: validity does not depend on the seed
        try:
            cfg = tg.parse_args(trainer_flags(sweep, run))
        except tg.ConfigError as e:
            raise SweepError(f"arm {run.arm.label}: {e}") from None
        key = runlogs.experiment_config(expected_log(tg, cfg))
        twin = next((label for label, other in experiments.items() if other == key), None)
        if twin is not None:
            raise SweepError(f"arms {twin} and {run.arm.label} are the same configuration (the same experiment: "
                             "they differ in no field of the groups " + ", ".join(tg.EXPERIMENT_GROUPS) + ")")
        experiments[run.arm.label] = key
    for run in plan(sweep, out):
        outcome = inspect(run)
        if outcome.status != "finished":
            continue
        log = outcome.metrics
        expected = expected_log(tg, tg.parse_args(trainer_flags(sweep, run))).config
        checked = {**runlogs.experiment_config(log), **({"seed": log.seed} if log.seed is not None else {})}
        for name, text in checked.items():
            if name in expected and expected[name] != text:
                raise SweepError(f"--out {out}: {log.path} ran with {name} = {text}, this sweep asks for "
                                 f"{expected[name]}; use another --out (or delete that run's folder)")


# -----------------------------------------------------------------------------
# Statistics (all tests from records/stats.py)

def _values(outcomes: list[Outcome], metric: str) -> dict[int, float]:
    """{seed: value} of the finished runs that report the metric."""
    return {o.run.seed: getattr(o.metrics, metric) for o in outcomes
            if o.status == "finished" and getattr(o.metrics, metric) is not None}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def compare(base: list[Outcome], arm: list[Outcome], metric: str) -> dict | None:
    """B - A for one metric: per-seed deltas, the paired test over shared seeds, Welch over all runs."""
    a, b = _values(base, metric), _values(arm, metric)
    if not a or not b:
        return None
    seeds = [s for s in a if s in b]
    paired = stats.paired_test([a[s] for s in seeds], [b[s] for s in seeds]) if len(seeds) >= 2 else None
    two_sample = stats.welch(list(a.values()), list(b.values())) if len(a) >= 2 and len(b) >= 2 else None
    return dict(seeds=seeds, deltas=[b[s] - a[s] for s in seeds], mean_a=_mean(a.values()),
                mean_b=_mean(b.values()), paired=paired, welch=two_sample)


def interaction(sweep: Sweep, by_arm: dict[str, list[Outcome]], metric: str) -> dict | None:
    """For two switches of two values each: single-switch and joint deltas from the corner arm (both
    first values), their sum, and the paired test of joint against the sum over seeds with all four."""
    if len(sweep.grid) != 2 or any(len(values) != 2 for _, values in sweep.grid):
        return None
    (f1, (a0, a1)), (f2, (b0, b1)) = sweep.grid
    corner = {key: Arm(((f1, v1), (f2, v2))).name for key, v1, v2 in
              (("base", a0, b0), ("first", a1, b0), ("second", a0, b1), ("both", a1, b1))}
    vals = {key: _values(by_arm[name], metric) for key, name in corner.items()}
    seeds = [s for s in sweep.seeds if all(s in v for v in vals.values())]
    if not seeds:
        return None
    delta = {key: float(np.mean([vals[key][s] - vals["base"][s] for s in seeds])) for key in ("first", "second", "both")}
    additive = [vals["first"][s] + vals["second"][s] - vals["base"][s] for s in seeds]
    return dict(fields=[f1, f2], values=[[a0, a1], [b0, b1]], arms=corner, seeds=seeds, delta_first=delta["first"],
                delta_second=delta["second"], delta_both=delta["both"], sum_of_singles=delta["first"] + delta["second"],
                interaction=delta["both"] - delta["first"] - delta["second"],
                test=stats.paired_test(additive, [vals["both"][s] for s in seeds]) if len(seeds) >= 2 else None)


def summarize(sweep: Sweep, outcomes: list[Outcome]) -> dict:
    """The report's numbers: per-arm descriptions, comparisons with the baseline, bands, 2x2 interaction."""
    by_arm = {arm.name: [o for o in outcomes if o.run.arm == arm] for arm in sweep.arms()}
    base = sweep.baseline_arm()
    quality = QUALITY[sweep.band_metric]

    def cost(runs):  # package time (training + final evaluation); training time where a log lacks it
        return _mean([o.metrics.package_time_s or o.metrics.train_time_s for o in runs if o.status == "finished"])

    arms = []
    for arm in sweep.arms():
        runs = by_arm[arm.name]
        done = [o.metrics for o in runs if o.status == "finished"]
        entry = dict(name=arm.name, label=arm.label, n=len(done), failed=sum(o.status == "failed" for o in runs),
                     not_run=sum(o.status == "not run" for o in runs))
        for metric in ("val_loss", "val_bpb", "step0_train_loss"):
            values = list(_values(runs, metric).values())
            entry[metric] = stats.describe(values) if values else None
        entry.update(train_time_s=_mean(m.train_time_s for m in done), package_time_s=_mean(m.package_time_s for m in done),
                     peak_memory_mib=_mean(m.peak_memory_mib for m in done),
                     params_total=sorted({m.params_total for m in done if m.params_total is not None}))
        if arm != base:
            entry["vs_baseline"] = {metric: compare(by_arm[base.name], runs, metric) for metric in COMPARED}
            q = entry["vs_baseline"][quality]
            base_cost, arm_cost = cost(by_arm[base.name]), cost(runs)
            entry["time_ratio"] = arm_cost / base_cost if base_cost and arm_cost else None
            inside = []
            if sweep.band_loss is not None:
                inside.append(None if q is None else q["mean_b"] - q["mean_a"] <= sweep.band_loss)
            if sweep.band_time is not None:
                inside.append(None if entry["time_ratio"] is None else entry["time_ratio"] <= sweep.band_time)
            entry["inside_bands"] = None if not inside or None in inside else all(inside)
        arms.append(entry)
    return dict(baseline=base.name, band_metric=quality, band_loss=sweep.band_loss, band_time=sweep.band_time,
                runs={s: sum(o.status == s for o in outcomes) for s in ("finished", "failed", "not run")},
                arms=arms, interaction={m: interaction(sweep, by_arm, m) for m in ("val_loss", "val_bpb")},
                failures=[dict(arm=o.run.arm.name, seed=o.run.seed, reason=o.reason)
                          for o in outcomes if o.status == "failed"],
                scripts=dict(Counter(o.metrics.script for o in outcomes if o.status == "finished")),
                changes=arm_changes(sweep, by_arm), mixed_arms=mixed_arms(sweep, by_arm))


def _first_log(runs: list[Outcome]) -> runlogs.RunLog | None:
    return next((o.metrics for o in runs if o.status == "finished"), None)


def arm_changes(sweep: Sweep, by_arm: dict[str, list[Outcome]]) -> dict[str, dict[str, list[str]]]:
    """{arm: {field: [baseline value, arm value]}}: the experiment-defining config fields in which each
    arm's first finished log differs from the baseline's, however many fields its grid values set."""
    base = _first_log(by_arm[sweep.baseline_arm().name])
    out = {}
    for arm in sweep.arms():
        log = _first_log(by_arm[arm.name])
        if base is not None and log is not None and arm != sweep.baseline_arm():
            out[arm.name] = {k: list(v) for k, v in runlogs.config_differences(base, log).items()}
    return out


def mixed_arms(sweep: Sweep, by_arm: dict[str, list[Outcome]]) -> dict[str, list[str]]:
    """{arm: [what sets each group apart]} for arms whose finished runs are more than one experiment."""
    out = {}
    for arm in sweep.arms():
        groups = runlogs.group_runs([o.metrics for o in by_arm[arm.name] if o.status == "finished"])
        if len(groups) > 1:
            out[arm.name] = [f"{g.name}: {len(g.logs)} run(s), {g.differences(limit=3)}" for g in groups]
    return out


# -----------------------------------------------------------------------------
# Writing runs.csv, report.md and report.json

CSV_COLUMNS = ["arm", "seed", "status", "val_loss", "val_bpb", "step0_train_loss", "train_time_s", "package_time_s",
               "peak_memory_mib", "params_total", "script", "log", "reason"]


def write_csv(outcomes: list[Outcome], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        for o in outcomes:
            row = dict(arm=o.run.arm.name, seed=o.run.seed, status=o.status, reason=o.reason)
            if o.metrics is not None:
                row.update({k: getattr(o.metrics, k) for k in CSV_COLUMNS[3:-2]}, log=o.metrics.path)
            writer.writerow(row)


def _num(x, spec=".6f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _mean_std(d: dict | None, spec=".6f") -> str:
    if d is None:
        return "n/a"
    return f"{d['mean']:{spec}} ± {_num(d['std'], spec)}"


def _script_warning(s: dict) -> list[str]:
    """A warning when the finished runs come from different trainer scripts: a different experiment each."""
    if len(s["scripts"]) < 2:
        return []
    counts = ", ".join(f"{digest}: {n} run(s)" for digest, n in s["scripts"].items())
    return ["", f"**Warning: the finished runs come from {len(s['scripts'])} different trainer scripts** ({counts}; "
            "the `script` column of runs.csv says which). Compare like with like: rerun into a fresh --out."]


def _mixed_warning(s: dict) -> list[str]:
    """A warning per arm whose runs are more than one experiment (records/runlogs.py's rule)."""
    out = []
    for arm, groups in s["mixed_arms"].items():
        out += ["", f"**Warning: arm `{arm}` holds runs of {len(groups)} different experiments** "
                f"({'; '.join(groups)}): its statistics mix them. Rerun into a fresh --out."]
    return out


def _changes_section(sweep: Sweep, s: dict) -> list[str]:
    """What each arm's logs say it changed against the baseline's (all experiment-defining fields)."""
    if not s["changes"]:
        return []
    out = ["", "## What each arm changes", "",
           "The experiment-defining config fields in which an arm's first finished log differs from the "
           "baseline's (a grid value such as a recipe name can set many).", "",
           "| arm | fields (baseline → arm) |", "|---|---|"]
    labels = {a.name: a.label for a in sweep.arms()}
    for arm, changed in s["changes"].items():
        text = "; ".join(f"`{k}`: {a} → {b}" for k, (a, b) in changed.items()) or "none"
        out.append(f"| `{labels[arm]}` | {text} |")
    return out


def render_report(sweep: Sweep, s: dict) -> str:
    """report.md: arms, deltas against the baseline with both tests, bands, the 2x2 interaction, failures."""
    base = next(a for a in s["arms"] if a["name"] == s["baseline"])
    out = ["# Ablation report", "",
           f"Preset `{sweep.preset}`, seeds {', '.join(map(str, sweep.seeds))}, "
           f"extra trainer flags `{' '.join(sweep.extra) or '(none)'}`.",
           f"Runs: {s['runs']['finished']} finished, {s['runs']['failed']} failed, {s['runs']['not run']} not run.",
           f"Baseline: `{base['label']}`. Deltas are arm − baseline (negative loss = better).",
           "Paired test: over the seeds where both arms finished (one seed: the same initial values of every "
           "tensor the two arms share). Welch's test: all finished runs, unpaired. 95% confidence intervals, "
           "two-sided p.", *_script_warning(s), *_mixed_warning(s), "",
           "## Arms", "",
           "| arm | n | val loss (mean ± std) | val BPB (mean ± std) | step-0 train loss | train time s | "
           "package time s | params | peak memory MiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for a in s["arms"]:
        params = "/".join(f"{p:,}" for p in a["params_total"]) or "n/a"
        out.append(f"| `{a['label']}` | {a['n']} | {_mean_std(a['val_loss'])} | {_mean_std(a['val_bpb'])} | "
                   f"{_num(a['step0_train_loss'] and a['step0_train_loss']['mean'])} | {_num(a['train_time_s'], '.2f')} | "
                   f"{_num(a['package_time_s'], '.2f')} | {params} | {_num(a['peak_memory_mib'], '.0f')} |")
    others = [a for a in s["arms"] if "vs_baseline" in a]
    titles = {"val_loss": "final val loss", "val_bpb": "val BPB", "train_time_s": "training time (s)"}
    for metric in COMPARED:
        rows = [(a, a["vs_baseline"][metric]) for a in others if a["vs_baseline"][metric]]
        if not rows:
            continue
        spec = ".3f" if metric == "train_time_s" else ".6f"
        out += ["", f"## Against the baseline: {titles[metric]}", "",
                "| arm | seeds | mean Δ (paired) | 95% CI | t | p | Welch Δ | 95% CI | t | p |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for a, c in rows:
            p, w = c["paired"], c["welch"]
            paired = (f"{_num(p['mean_diff'], spec)} | [{_num(p['ci95'][0], spec)}, {_num(p['ci95'][1], spec)}] | "
                      f"{_num(p['t'], '.4f')} | {_num(p['p_two_sided'], '.4g')}") if p else "n/a (< 2 pairs) | | |"
            welch = (f"{_num(w['diff_b_minus_a'], spec)} | [{_num(w['ci95'][0], spec)}, {_num(w['ci95'][1], spec)}] | "
                     f"{_num(w['t'], '.4f')} | {_num(w['p_two_sided'], '.4g')}") if w else "n/a (< 2 runs per arm) | | |"
            out.append(f"| `{a['label']}` | {len(c['seeds'])} | {paired} | {welch} |")
        if metric == "val_loss":
            out += ["", "Per-seed deltas of the final val loss (arm − baseline, same seed):", "",
                    "| arm | " + " | ".join(f"seed {x}" for x in sweep.seeds) + " |",
                    "|---|" + "---|" * len(sweep.seeds)]
            for a, c in rows:
                by_seed = dict(zip(c["seeds"], c["deltas"]))
                out.append(f"| `{a['label']}` | " + " | ".join(_num(by_seed.get(x), "+.6f") for x in sweep.seeds) + " |")
    out += _changes_section(sweep, s)
    if s["band_loss"] is not None or s["band_time"] is not None:
        out += ["", "## Tolerance bands", "",
                f"Inside: mean {s['band_metric']} at most baseline + {_num(s['band_loss'], 'g')} and mean package "
                f"time at most {_num(s['band_time'], 'g')} x baseline (a band not given is not checked).", "",
                "| arm | Δ mean | time ratio | inside |", "|---|---|---|---|"]
        for a in others:
            q = a["vs_baseline"][s["band_metric"]]
            verdict = {True: "yes", False: "no", None: "n/a"}[a["inside_bands"]]
            out.append(f"| `{a['label']}` | {_num(q and q['mean_b'] - q['mean_a'], '+.6f')} | "
                       f"{_num(a['time_ratio'], '.3f')} | {verdict} |")
    for metric, it in s["interaction"].items():
        if it is None:
            continue
        (f1, f2), ((a0, a1), (b0, b1)) = it["fields"], it["values"]
        t = it["test"]
        out += ["", f"## 2x2 interaction: {titles[metric]}", "",
                f"Mean paired deltas from `{f1}={a0} {f2}={b0}` over seeds {', '.join(map(str, it['seeds']))}.", "",
                f"| | {f2}={b0} | {f2}={b1} |", "|---|---|---|",
                f"| {f1}={a0} | 0 | {_num(it['delta_second'], '+.6f')} |",
                f"| {f1}={a1} | {_num(it['delta_first'], '+.6f')} | {_num(it['delta_both'], '+.6f')} |", "",
                f"Sum of the single-switch deltas: {_num(it['sum_of_singles'], '+.6f')}; joint delta: "
                f"{_num(it['delta_both'], '+.6f')}; interaction (joint − sum): {_num(it['interaction'], '+.6f')}"
                + (f", 95% CI [{_num(t['ci95'][0], '+.6f')}, {_num(t['ci95'][1], '+.6f')}], t={_num(t['t'], '.4f')}, "
                   f"p={_num(t['p_two_sided'], '.4g')} (paired over seeds)." if t else " (one seed: no test).")]
    if s["failures"]:
        out += ["", "## Failed runs", ""]
        out += [f"- `{f['arm']}` seed {f['seed']}: {f['reason']}" for f in s["failures"]]
    return "\n".join(out) + "\n"


def write_results(sweep: Sweep, out: Path, outcomes: list[Outcome]) -> dict:
    """runs.csv, report.md and report.json from the outcomes; returns the summary."""
    summary = summarize(sweep, outcomes)
    write_csv(outcomes, out / "runs.csv")
    (out / "report.md").write_text(render_report(sweep, summary))
    (out / "report.json").write_text(json.dumps(stats.json_safe(summary), indent=2) + "\n")
    return summary


# -----------------------------------------------------------------------------
# The sweep loop

def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _say(line: str) -> None:
    """A progress line on stdout, printed around the progress bar (if one is drawn on stderr)."""
    with tqdm.tqdm.external_write_mode(file=sys.stdout):
        print(line, flush=True)


def run_sweep(sweep: Sweep, out: Path) -> list[Outcome]:
    """Run what is missing, seed-major, with a progress line per run and, on a terminal, a progress bar
    with the elapsed time and an ETA (tqdm, on stderr); results rewritten after each run.

    Every run's folder is looked at once before the loop and the launched run's once after it, so a
    sweep of n runs reads each finished log once (not n times)."""
    runs = plan(sweep, out)
    outcomes = [inspect(r) for r in runs]
    write_results(sweep, out, outcomes)
    todo = sum(o.status != "finished" for o in outcomes)
    tqdm.tqdm.monitor_interval = 0  # no monitor thread: the runs are started with fork
    bar = tqdm.tqdm(total=todo, desc="sweep", unit="run", file=sys.stderr, disable=None, smoothing=0,
                    dynamic_ncols=True)
    start, durations = time.perf_counter(), []
    for i, run in enumerate(runs):
        where = f"[run {i + 1}/{len(runs)}] arm {run.arm.label}, seed {run.seed}"
        if outcomes[i].status == "finished":
            _say(f"{where}: finished before ({outcomes[i].metrics.path}), skipped")
            continue
        todo -= 1
        eta = _clock(np.mean(durations) * (todo + 1)) if durations else "unknown until one run ends"
        _say(f"{where}: running; {todo} left after this, elapsed {_clock(time.perf_counter() - start)}, "
             f"remaining ~{eta}")
        t0 = time.perf_counter()
        outcomes[i] = launch(sweep, run)
        durations.append(time.perf_counter() - t0)
        bar.update(1)
        result = (f"val_loss {outcomes[i].metrics.val_loss:.6f}" if outcomes[i].status == "finished"
                  else f"FAILED: {outcomes[i].reason} (see {run.folder / 'stderr.log'})")
        _say(f"{where}: {result} in {durations[-1]:.1f} s")
        write_results(sweep, out, outcomes)
    bar.close()
    return outcomes


def load_sweep(out: Path) -> Sweep:
    """The sweep saved in <out>/sweep.json."""
    path = Path(out) / "sweep.json"
    if Path(out).exists() and not Path(out).is_dir():
        raise SweepError(f"--out {out}: is a file, not a sweep's output folder")
    if not path.exists():
        raise SweepError(f"--out {out}: no sweep.json there (not the output folder of an ablate.py sweep)")
    try:
        return Sweep(**json.loads(path.read_text()))
    except OSError as e:
        raise SweepError(f"{path}: cannot read: {e.strerror or e}") from None
    except (ValueError, TypeError) as e:  # not JSON, or not the fields a sweep has
        raise SweepError(f"{path}: not a sweep description ({e}); re-run the sweep command to rewrite it") from None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="medium", help="trainer preset (medium = the record, tiny = CPU)")
    parser.add_argument("--grid", action="append", default=[], metavar="FIELD=V1,V2",
                        help="one axis of the grid; repeat for more axes")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds, each run for every arm")
    parser.add_argument("--launcher", default=DEFAULT_LAUNCHER,
                        help="command that takes trainer flags (default: the repository's run.sh)")
    parser.add_argument("--out", type=Path, help="output folder (default: logs/ablations/<preset>-<fields>)")
    parser.add_argument("--baseline", help="arm to compare against, by name or label (default: the first arm)")
    parser.add_argument("--band-loss", type=float, help="tolerance: mean quality at most baseline + this")
    parser.add_argument("--band-time", type=float, help="tolerance: mean package time at most this x baseline")
    parser.add_argument("--band-metric", choices=sorted(QUALITY), help="quality metric of --band-loss (default loss)")
    parser.add_argument("--dry_run", action="store_true", help="list the runs and their commands, run nothing")
    parser.add_argument("--report-only", action="store_true", help="re-make runs.csv and the report from --out's logs")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors exit 2, --help 0
        return e.code
    try:
        for name in ("band_loss", "band_time"):
            if getattr(args, name) is not None and not getattr(args, name) > 0:
                raise SweepError(f"--{name.replace('_', '-')} must be positive")
        overrides = {k: getattr(args, k) for k in ("baseline", "band_loss", "band_time", "band_metric")
                     if getattr(args, k) is not None}
        if args.report_only:
            if args.out is None:
                raise SweepError("--report-only needs --out DIR (the sweep's output folder)")
            sweep = Sweep(**{**asdict(load_sweep(args.out)), **overrides})
            sweep.baseline_arm()
            try:
                summary = write_results(sweep, args.out, [inspect(r) for r in plan(sweep, args.out)])
            except OSError as e:
                raise SweepError(f"--out {args.out}: cannot write the report: {e.strerror or e}") from None
            if not summary["runs"]["finished"]:
                raise SweepError(f"--out {args.out}: no finished runs yet")
            print(f"wrote {args.out / 'runs.csv'} and {args.out / 'report.md'}")
            return 0
        sweep = Sweep(preset=args.preset, grid=[parse_grid(g) for g in args.grid], seeds=parse_seeds(args.seeds),
                      extra=extra, launcher=args.launcher, **overrides)
        out = (args.out or Path("logs/ablations") / "-".join([args.preset] + [f for f, _ in sweep.grid])).resolve()
        check_sweep(sweep, out)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = plan(sweep, out)
    if args.dry_run:
        for i, run in enumerate(runs, start=1):
            state = " (finished before: would be skipped)" if inspect(run).status == "finished" else ""
            print(f"[run {i}/{len(runs)}] arm {run.arm.label}, seed {run.seed}{state}\n  {shlex.join(command(sweep, run))}")
        return 0
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(asdict(sweep), indent=2) + "\n")
    except OSError as e:
        print(f"error: --out {out}: cannot write there: {e.strerror or e}; choose another --out", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs ({len(sweep.arms())} arms x {len(sweep.seeds)} seeds) into {out}", flush=True)
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        outcomes = run_sweep(sweep, out)
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"\ninterrupted: rerun the same command to continue; finished runs are kept in {out}", file=sys.stderr)
        return 143 if isinstance(e, Interrupted) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [o for o in outcomes if o.status == "failed"]
    print(f"wrote {out / 'runs.csv'} and {out / 'report.md'}; {len(outcomes) - len(failed)} finished, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
