"""Pictures of runs (PNG): validation curves, an ablation's quality against cost, a run's lambdas.

    python records/plot.py curves PATH ... [--zoom FRAC] [--target 2.92|none] [-o curves.png]
    python records/plot.py ablation PATH ... [--metric loss|bpb] [--baseline ARM] [--band-loss X] [--band-time R] [-o ablation.png]
    python records/plot.py lambdas LOG [-o lambdas.png]

PATH is a log file (one run), a metrics stream of one run (`--metrics_jsonl`'s *.jsonl), a folder
of logs (searched recursively, *.txt only), or the output folder of records/ablate.py (one group per arm). A group is drawn as its mean with a min-max band; a folder
(or arm) whose runs are more than one experiment (records/runlogs.py's rule, the one stats.py
tests by) is drawn as one group per experiment, labelled `PATH [A: what differs]`, never as one
mix. Only finished logs count (those with the final `step:N/N val_loss` line). -o takes any file
type matplotlib writes (.png, .pdf, .svg, ...). Exit status: 0 written, 2 unusable input (a path
without finished runs, a log without lambdas lines, an output path that cannot be written): nothing
is drawn then.
"""

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository root instead of records/ on the path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402

from records import ablate, runlogs  # noqa: E402

plt = None  # matplotlib.pyplot, imported by _matplotlib() once the arguments are known to be good


class PlotError(Exception):
    """Nothing to draw from the input given."""


# -----------------------------------------------------------------------------
# Input: groups of finished runs

def _matplotlib():
    """matplotlib.pyplot, drawing to files only (imported on first use: argument errors come first)."""
    global plt
    if plt is None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot
        plt = matplotlib.pyplot
    return plt


def split_by_experiment(label: str, logs: list[runlogs.RunLog]) -> list[tuple[str, list[runlogs.RunLog]]]:
    """One (label, runs) per experiment among `logs`: the label alone for one experiment, else
    `label [A: what differs]` per group, and a note on stderr saying so."""
    experiments = runlogs.group_runs(logs)
    if len(experiments) == 1:
        return [(label, experiments[0].logs)]
    print(f"note: {label} holds {len(experiments)} experiments; drawn as {len(experiments)} groups: "
          + "; ".join(f"{g.name}: {g.differences(limit=3)}" for g in experiments), file=sys.stderr)
    return [(f"{label} [{g.name}: {g.differences(limit=2)}]", g.logs) for g in experiments]


def groups(paths: list[str]) -> list[tuple[str, list[runlogs.RunLog]]]:
    """(label, finished runs) per experiment of each log file, folder, or arm of an ablate.py output
    folder. Raises PlotError naming the first path that has no finished run."""
    out = []
    for path in map(Path, paths):
        if not path.exists():
            raise PlotError(f"{path}: no such file or folder")
        if (path / "sweep.json").is_file():
            sweep = ablate.load_sweep(path)
            done = [o for o in map(ablate.inspect, ablate.plan(sweep, path)) if o.status == "finished"]
            if not done:
                raise PlotError(f"{path}: no finished runs in this ablation folder yet")
            for arm in sweep.arms():
                runs = [o.metrics for o in done if o.run.arm == arm]
                if runs:
                    out.extend(split_by_experiment(arm.label, runs))
            continue
        try:
            runs = [log for log in runlogs.read_logs([path], recursive=True, empty_ok=True) if log.finished]
        except runlogs.LogError as e:
            raise PlotError(str(e)) from None
        if not runs:
            what = "log did not finish" if path.is_file() else "folder holds no finished log (*.txt)"
            raise PlotError(f"{path}: no finished runs: the {what}; a finished log has the final `step:N/N val_loss` line")
        out.extend(split_by_experiment(path.stem if path.is_file() else path.name, runs))
    return out


def mean_curve(runs: list[runlogs.RunLog], x_key: str) -> tuple[np.ndarray, ...]:
    """x, mean, min, max of the val loss at the val steps every run has (x averaged over runs)."""
    steps = sorted(set.intersection(*({h["step"] for h in r.history} for r in runs)))
    table = [{h["step"]: h for h in r.history} for r in runs]
    x = np.array([[t[s][x_key] for s in steps] for t in table]).mean(axis=0)
    loss = np.array([[t[s]["val_loss"] for s in steps] for t in table])
    return x, loss.mean(axis=0), loss.min(axis=0), loss.max(axis=0)


def output_format(path: Path) -> str:
    """The file type -o asks for (its suffix), if matplotlib can write it; else PlotError."""
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = path.suffix[1:].lower()
    if kind not in kinds:
        given = f"ends in {path.suffix!r}" if path.suffix else "has no file type"
        raise PlotError(f"-o {path}: {given}; give a name ending in one of "
                        + ", ".join(f".{k}" for k in sorted(kinds)) + " (e.g. .png)")
    return kind


def _save(fig, path: Path, dpi: int) -> None:
    """Write the picture; a folder that cannot be made or written is a PlotError naming the path."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi, bbox_inches="tight", format=path.suffix[1:].lower())
    except OSError as e:
        raise PlotError(f"-o {path}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)


# -----------------------------------------------------------------------------
# Pictures

def plot_curves(data, out: Path, zoom: float | None, target: float | None, dpi: int) -> None:
    """Val loss against step and against training time; a group of several runs as mean and min-max band.
    The target line is drawn only where it falls inside the plotted loss range (a tiny run at loss 5
    would otherwise be squashed against a line at 2.92)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (x_key, x_label) in zip(axes, (("step", "step"), ("train_time_s", "training time (s)"))):
        curves = [(label, len(runs), *mean_curve(runs, x_key)) for label, runs in data]
        x_end = max(c[2].max() for c in curves)
        x_start = x_end * (1 - zoom) if zoom else -np.inf  # the window every group is judged in
        lo_y, hi_y = [], []
        for label, n, x, mean, lo, hi in curves:
            keep = x >= x_start
            line, = ax.plot(x, mean, marker="." if len(x) < 30 else None, label=f"{label} (n={n})")
            if n > 1:
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            if keep.any():  # a group that ended before the window has nothing in it
                lo_y.append(lo[keep].min())
                hi_y.append(hi[keep].max())
        if zoom:
            ax.set_xlim(x_start, x_end + (x_end - x_start) * 0.02)
        y0, y1 = min(lo_y), max(hi_y)
        pad = (y1 - y0) * 0.05 or 0.01
        ax.set_ylim(y0 - pad, y1 + pad)
        if target is not None and y0 - pad <= target <= y1 + pad:
            ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(x_label)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle("validation loss" + (f" (last {zoom:.0%} of training)" if zoom else ""))
    _save(fig, out, dpi)


def plot_ablation(data, out: Path, metric: str, baseline: str | None, band_loss: float | None,
                  band_time: float | None, dpi: int) -> None:
    """Quality (final val loss or BPB) against cost (package time), one point per run, arm means
    marked; bands from the baseline arm's mean: quality up to + band_loss, time up to x band_time."""
    key = ablate.QUALITY[metric]
    labels = [label for label, _ in data]
    if baseline is not None and baseline not in labels:
        raise PlotError(f"--baseline {baseline!r} is not one of: {', '.join(labels)}")
    fig, ax = plt.subplots(figsize=(7, 5))
    means = {}
    for label, runs in data:
        points = [(r.package_time_s or r.train_time_s, getattr(r, key)) for r in runs]
        points = [(x, y) for x, y in points if x is not None and y is not None]
        if not points:
            raise PlotError(f"{label}: no run reports {key} (logs without val_bpb; use --metric loss)")
        xs, ys = np.array(points).T
        dots = ax.scatter(xs, ys, s=18, alpha=0.6)
        means[label] = (xs.mean(), ys.mean())
        ax.scatter(*means[label], s=120, marker="D", color=dots.get_facecolor()[0], edgecolor="black",
                   label=f"{label} (n={len(xs)})")
    base_x, base_y = means[baseline or labels[0]]
    if band_loss is not None:
        ax.axhline(base_y + band_loss, color="gray", linestyle="--", linewidth=1)
    if band_time is not None:
        ax.axvline(base_x * band_time, color="gray", linestyle="--", linewidth=1)
    if band_loss is not None or band_time is not None:  # the tolerated region: cheap enough and good enough
        x_lim, y_lim = ax.get_xlim(), ax.get_ylim()
        x_hi = base_x * band_time if band_time is not None else x_lim[1]
        y_hi = base_y + band_loss if band_loss is not None else y_lim[1]
        ax.fill_between([x_lim[0], x_hi], y_lim[0], y_hi, color="green", alpha=0.08, label="inside the bands")
        ax.set_xlim(x_lim)
        ax.set_ylim(y_lim)
    ax.set_xlabel("package time: training + final evaluation (s)")
    ax.set_ylabel({"loss": "final val loss", "bpb": "final val BPB"}[metric])
    ax.set_title(f"quality against cost (baseline: {baseline or labels[0]})", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, out, dpi)


def plot_lambdas(run: runlogs.RunLog, out: Path, dpi: int) -> None:
    """The learned lambdas per layer: the block's mixing weights (x, x00, x01, ...) and the attention
    and skip weights, from the log's final `lambdas layer i:` lines."""
    from matplotlib.ticker import MaxNLocator
    layers = sorted(run.lambdas)
    names = list(run.lambdas[layers[0]])
    mix = [n for n in names if n == "x" or n.startswith("x0")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, chosen, title in ((axes[0], mix, "block input mix"), (axes[1], [n for n in names if n not in mix],
                                                                  "attention value mix and skip weights")):
        for name in chosen:
            ax.plot(layers, [run.lambdas[i].get(name, np.nan) for i in layers], marker="o", markersize=3, label=name)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("learned value")
    fig.suptitle(f"learned lambdas: {run.path.name}", fontsize="medium")
    _save(fig, out, dpi)


# -----------------------------------------------------------------------------
# Command line

def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 written, 2 unusable input)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--output", type=Path, help="PNG file to write (default: <command>.png)")
    common.add_argument("--dpi", type=int, default=80, help="resolution (80 keeps a picture at a few tens of KB)")
    curves = sub.add_parser("curves", parents=[common], help="val loss against step and training time")
    curves.add_argument("paths", nargs="+", metavar="PATH")
    curves.add_argument("--zoom", type=float, help="show only the last FRAC of training (0 < FRAC < 1)")
    curves.add_argument("--target", default="2.92", help="loss line to draw when in range, or 'none'")
    abl = sub.add_parser("ablation", parents=[common], help="quality against package time, one point per run")
    abl.add_argument("paths", nargs="+", metavar="PATH")
    abl.add_argument("--metric", choices=sorted(ablate.QUALITY), default="loss")
    abl.add_argument("--baseline", help="arm (label or folder) the bands start from (default: the sweep's, else the first)")
    abl.add_argument("--band-loss", type=float, help="band: quality up to baseline mean + this")
    abl.add_argument("--band-time", type=float, help="band: package time up to baseline mean x this")
    lam = sub.add_parser("lambdas", parents=[common], help="learned lambdas per layer of one run")
    lam.add_argument("paths", nargs=1, metavar="LOG")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors exit 2, --help 0
        return e.code
    out = args.output or Path(f"{args.command}.png")
    try:
        output_format(out)
        if args.command == "curves":
            if args.zoom is not None and not 0 < args.zoom < 1:
                raise PlotError(f"--zoom {args.zoom}: give the fraction of training to show, 0 < FRAC < 1")
            try:
                target = None if args.target.lower() == "none" else float(args.target)
            except ValueError:
                raise PlotError(f"--target {args.target!r}: give a loss or 'none'") from None
            plot_curves(groups(args.paths), out, args.zoom, target, args.dpi)
        elif args.command == "ablation":
            data, baseline = groups(args.paths), args.baseline
            bands = dict(band_loss=args.band_loss, band_time=args.band_time)
            sweep_file = Path(args.paths[0]) / "sweep.json"
            if len(args.paths) == 1 and sweep_file.is_file():  # the sweep's own baseline and bands, unless overridden
                sweep = ablate.load_sweep(args.paths[0])
                baseline = baseline or sweep.baseline_arm().label
                bands = {k: v if v is not None else getattr(sweep, k) for k, v in bands.items()}
                baseline = next((a.label for a in sweep.arms() if baseline in (a.name, a.label)), baseline)
            plot_ablation(data, out, args.metric, baseline, bands["band_loss"], bands["band_time"], args.dpi)
        else:
            runs = [r for _, group in groups(args.paths) for r in group]
            if len(runs) > 1:
                raise PlotError(f"{args.paths[0]}: holds {len(runs)} finished logs; give one log file")
            run = runs[0]
            if not run.lambdas:
                raise PlotError(f"{run.path}: no `lambdas layer i:` lines (a log from before they were written)")
            plot_lambdas(run, out, args.dpi)
    except (PlotError, ablate.SweepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from tools.cli import run_main
    run_main(main)
