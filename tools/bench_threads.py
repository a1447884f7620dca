"""The measurement behind the CPU thread policy (docs/inputs.md, "CPU threads"): seconds per
training step of the tiny preset with 1 thread, 2 threads and one thread per core (what torch
would pick by itself), each on an otherwise idle machine and with one core kept busy by another
program.

    python tools/bench_threads.py                                  # 30 steps, 3 repeats per case
    python tools/bench_threads.py --num_iterations=5 --repeats=1   # a quick check that it works

Each case is a fresh process, run from the repository root:
    train_gpt_medium.py --preset=tiny --device=cpu --num_iterations=N --val_every=0 --warmup_steps=0
                        --seed=0 --threads=T --log_dir=<temporary folder>
s/step is the final validation line's train_time divided by N (the timed loop only: no start-up,
no validation). The busy core is a `python -c "while True: pass"` process started before the run
and killed after it. Repeats are interleaved (every case once, then again), so a change in the
machine's load spreads over all cases; the table shows the median and the range.
Run it on a machine with nothing else running: other programs are busy cores the table doesn't show.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from records import runlogs  # noqa: E402
from tools.cli import OneLineParser, run_main  # noqa: E402

LOADS = ("idle", "one busy core")


def thread_counts() -> list[tuple[int, str]]:
    """(threads, label): 1, 2 and one per core, without duplicates on a small machine."""
    cores = os.cpu_count() or 1
    counts = {1: "1", 2: "2"}
    counts[cores] = f"{cores} (one per core, torch's default)"
    return sorted(counts.items())


def seconds_per_step(threads: int, num_iterations: int, log_dir: Path) -> float:
    """One run of the trainer; its s/step from the log."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # --threads decides alone
    cmd = [sys.executable, "train_gpt_medium.py", "--preset=tiny", "--device=cpu", f"--num_iterations={num_iterations}",
           "--val_every=0", "--warmup_steps=0", "--seed=0", f"--threads={threads}", f"--log_dir={log_dir}"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the run failed (exit {result.returncode}): {' '.join(cmd)}\n{result.stderr[-2000:]}")
    (log,) = runlogs.read_logs([log_dir])
    return log.result.train_time_s / num_iterations


def measure(threads: int, load: str, num_iterations: int, log_dir: Path) -> float:
    """s/step of one run, with a busy-looping process beside it for the 'one busy core' load."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load != "idle" else None
    try:
        return seconds_per_step(threads, num_iterations, log_dir)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def table(results: dict[tuple[int, str], list[float]], labels: dict[int, str]) -> str:
    """Markdown: one row per thread count, the median s/step (and range) per load, busy / idle."""
    def cell(times: list[float]) -> str:
        spread = f" ({min(times):.3f}-{max(times):.3f})" if len(times) > 1 else ""
        return f"{statistics.median(times):.3f}{spread}"

    rows = ["| threads | idle s/step | one busy core s/step | busy / idle |", "|---|---|---|---|"]
    for threads, label in labels.items():
        idle, busy = results[threads, LOADS[0]], results[threads, LOADS[1]]
        ratio = statistics.median(busy) / statistics.median(idle)
        rows.append(f"| {label} | {cell(idle)} | {cell(busy)} | {ratio:.2f}x |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(__file__, description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_iterations", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the table shows the median (default 3)")
    args = parser.parse_args(argv)
    if args.num_iterations < 1 or args.repeats < 1:
        parser.error("--num_iterations and --repeats must be at least 1")
    labels = dict(thread_counts())
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; "
          f"{args.num_iterations} steps per run, {args.repeats} repeat(s)", flush=True)
    results: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for threads in labels:
                for load in LOADS:
                    log_dir = Path(tmp) / f"t{threads}_{load.replace(' ', '_')}_{repeat}"
                    seconds = measure(threads, load, args.num_iterations, log_dir)
                    results.setdefault((threads, load), []).append(seconds)
                    print(f"  repeat {repeat + 1}: {threads} thread(s), {load}: {seconds:.3f} s/step", flush=True)
    print(table(results, labels))
    return 0


if __name__ == "__main__":
    run_main(main)
