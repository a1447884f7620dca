"""One screen about a batch of runs, and the command that tests its claim (run.sh calls it after RUNS=N).

    python records/summary.py FOLDER [--since EPOCH_SECONDS] [--asked N [--asked-at EPOCH_SECONDS]]
                                     [--again COMMAND]

Lists the logs in FOLDER (with --since, only those written at or after that time): each run's
seed, final validation loss and training time, or why it did not finish; then the means, how
many experiments the runs are (records/runlogs.py's rule), and the exact records/stats.py command
for the batch. A batch continued by a later call of run.sh counts the runs of both: the runs that
finished before --asked-at add to the --asked ones. With --again, fewer finished runs than asked
end with `continue: RUNS=<missing> COMMAND`. Exit status: 0 (also when nothing finished: the
screen says so), 2 when FOLDER is not a folder.
"""

import argparse
import shlex
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository root instead of records/ on the path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from records import published, runlogs  # noqa: E402


def batch_logs(folder: Path, since: float | None) -> list[runlogs.RunLog]:
    """The logs of the batch: every *.txt in `folder` modified at or after `since` (all without it)."""
    files = runlogs.find_logs([folder], empty_ok=True)
    if since is not None:
        files = [f for f in files if f.stat().st_mtime >= since]
    return sorted((runlogs.read_log(f) for f in files), key=lambda log: log.path.stat().st_mtime)


def stats_command(folder: Path, logs: list[runlogs.RunLog]) -> str:
    """`python records/stats.py FOLDER --time-vs <latest record>` when the folder holds just this batch,
    else the batch's files: the claim's command, a record's time test included (for runs that are not
    medium-track runs, a tiny or a CPU batch, stats.py then says why there is no verdict)."""
    in_folder = runlogs.find_logs([folder], empty_ok=True)
    batch = {log.path.resolve() for log in logs}
    targets = [str(folder)] if {f.resolve() for f in in_folder} == batch else [str(log.path) for log in logs]
    return shlex.join(["python", "records/stats.py", *targets, "--time-vs", published.latest().recipe])


def summary(folder: Path, since: float | None = None, asked: int | None = None, asked_at: float | None = None,
            again: str | None = None) -> str:
    logs = batch_logs(folder, since)
    done = [log for log in logs if log.finished]
    # a continued batch: its runs that finished before this call was made count as asked too
    before = [log for log in done if asked_at is not None and log.path.stat().st_mtime < asked_at]
    head = f"batch: {folder}: {len(done)} finished run(s)"
    if asked:
        head += f" of {len(before) + asked} asked" + (f" ({len(before)} of them before this call)" if before else "")
    if len(logs) > len(done):
        head += f", {len(logs) - len(done)} unfinished log(s)"
    out = [head]
    missing = asked - (len(done) - len(before)) if asked else 0
    go_on = [f"continue: RUNS={missing} {again}"] if again and missing > 0 else []
    if not logs:
        return "\n".join(out + ["no logs were written (see the errors above)"] + go_on)
    out.append(f"  {'run':>3}  {'seed':>10}  {'val_loss':>9}  {'train_time':>10}  log")
    for i, log in enumerate(logs, start=1):
        seed = log.seed if log.seed is not None else "?"
        if log.finished:
            out.append(f"  {i:>3}  {seed:>10}  {log.val_loss:>9.6f}  {log.train_time_s:>9.3f}s  {log.path.name}")
        else:
            out.append(f"  {i:>3}  {seed:>10}  {'-':>9}  {'-':>10}  {log.path.name}: {log.skip_reason}")
    if done:
        losses, times = [log.val_loss for log in done], [log.train_time_s for log in done]
        spread = f" (std {statistics.stdev(losses):.6f})" if len(done) > 1 else ""
        out.append(f"mean val_loss {statistics.fmean(losses):.6f}{spread}, mean train_time {statistics.fmean(times):.3f}s")
        experiments = runlogs.group_runs(done)
        if len(experiments) > 1:
            out.append(f"{len(experiments)} experiments among these runs (stats.py tests them one at a time with --group): "
                       + "; ".join(f"{g.name}: {g.differences(limit=3)}" for g in experiments))
        if all(log.config.get("preset") == "'tiny'" for log in done):
            out.append("tiny runs: the statistics are real, but the 2.92 target and the published records "
                       "belong to the medium track")
        out.append(f"next: {stats_command(folder, done)}")
    return "\n".join(out + go_on)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--since", type=float, help="only logs modified at or after this time (seconds since the epoch)")
    parser.add_argument("--asked", type=int, help="how many runs the batch (this call of run.sh) asked for")
    parser.add_argument("--asked-at", type=float, help="when they were asked (seconds since the epoch): the "
                        "batch's runs finished before then count as asked too")
    parser.add_argument("--again", help="the command that adds runs to the batch, printed with RUNS=<missing> "
                        "when fewer runs finished than were asked")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code
    if not args.folder.is_dir():
        print(f"error: {args.folder}: not a folder of logs (no run wrote a log there)", file=sys.stderr)
        if args.again and args.asked:
            print(f"continue: RUNS={args.asked} {args.again}")
        return 2
    print(summary(args.folder, args.since, args.asked, args.asked_at, args.again))
    return 0


if __name__ == "__main__":
    from tools.cli import run_main
    run_main(main)
