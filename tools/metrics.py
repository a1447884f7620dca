"""The trainer's metrics stream (--metrics_jsonl) and tracker hook (--tracker): one JSON object per
step line and per validation, made from the lines the log already writes.

    python train_gpt_medium.py --preset tiny --metrics_jsonl=auto           # logs/<run>.jsonl beside the log
    python train_gpt_medium.py --preset tiny --metrics_jsonl=m.jsonl --tracker=tensorboard
    python records/plot.py curves logs/<run>.jsonl                          # plot.py reads it as it reads the log
    python tools/metrics.py --bench 20000                                   # its cost per step line, on this CPU

How it adds no host-device sync: it is a listener of the run log (RunLog.listeners), called with
each line after the line is written. It reads only that text (numbers the loop has already brought
to the host for the log: the train time, the validation loss, the step-0 loss) and pure functions
of the step (lr multiplier, Muon momentum, batch, windows, tokens seen, all tabulated when it
starts), and the memory counters of the CUDA caching allocator, which live on the host. It never
touches a tensor. So the step lines carry no training loss, as the log's do not: the loss of a
training step stays on the device (reading it every step would be a sync).

Records (every one has `kind` and `step`, the number of training steps done):
- run: the first line: the log's path, the script's digest, the config as the log's config lines
  give it ({field: repr}), each field's group, world size, device;
- step: one per `step:s/N train_time:...` line: train_time_ms, step_avg_ms (as the log rounds
  them), and for the step just trained lr_multiplier, muon_lr, muon_momentum, batch_tokens, the
  windows (blocks and tokens), tokens_seen, memory; the first also train_loss (the step-0 loss line);
- val: one per `step:s/N val_loss:...` line: val_loss, val_bpb, train_time_ms, the windows of the
  validation, tokens_seen, memory;
- final, peak_memory, checkpoint, resume, hellaswag: from their lines (hellaswag at full precision);
- end: from the log's last line (`run ended: ...`): `how` the run ended (finished; interrupted by
  SIGINT at step s/N; ...), for records/runlogs.py; no tracker gets it (it holds no number).
The file is appended to and flushed line by line (a crash keeps every record before it).

--tracker feeds the numbers of the same records to wandb (wandb.init in the log folder, run name =
the log's name; WANDB_MODE=offline works as usual) or tensorboard (torch's SummaryWriter into
<log_dir>/tensorboard/<run>), each imported only when asked. A tracker's own call runs where the
line is written, inside the timed loop for step lines: its time counts as training time.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from records.runlogs import parse_step_line, script_digest  # noqa: E402

if TYPE_CHECKING:
    import torch
    import train_gpt_medium as tg

FORMAT = 1  # the run record's "format"
_FINAL = re.compile(r"final val_loss:(\S+) perplexity:(\S+)(?: val_bpb:(\S+))? package_time:(\d+)ms")
_PEAK = re.compile(r"peak memory allocated: (\d+) MiB reserved: (\d+) MiB")
_RESUMED = re.compile(r"resumed from (\S+) at step (\d+)/(\d+)")
_ENDED, _AT_STEP = "run ended: ", re.compile(r" at step (\d+)/\d+")


def metrics_path(config: tg.Hyperparameters, log_path: Path) -> Optional[Path]:
    """--metrics_jsonl's file: 'auto' is the log's path with .jsonl; '' is none."""
    if not config.metrics_jsonl:
        return None
    return log_path.with_suffix(".jsonl") if is_auto(config.metrics_jsonl) else Path(config.metrics_jsonl)


def is_auto(value: str) -> bool:
    """--metrics_jsonl's 'auto', in any case (AUTO, Auto): a file of that name would be a surprise."""
    return value.lower() == "auto"


def check_request(config: tg.Hyperparameters) -> None:
    """Before training: ConfigError if the metrics file cannot be written (or exists, outside a
    resume: it belongs to another run) or the tracker's package is not installed."""
    import importlib.util
    import train_gpt_medium as tg
    if config.metrics_jsonl and not is_auto(config.metrics_jsonl):
        from tools.cli import output_file_problem
        # the tools' one policy for output files; a resumed run appends to its own file
        problem = output_file_problem(Path(config.metrics_jsonl), "--metrics_jsonl", overwrite=bool(config.resume),
                                      how="give auto (beside the log); only a resumed run appends to its file")
        if problem:
            raise tg.ConfigError(problem)
    package = {"wandb": "wandb", "tensorboard": "tensorboard"}.get(config.tracker)
    if package and importlib.util.find_spec(package) is None:  # looks for it without importing it
        raise tg.ConfigError(f"--tracker={config.tracker}: the {package} package is not installed (pip install "
                             f"{package}); or run without --tracker")


class Schedule:
    """The step's values the records carry, tabulated once before training (so a step line costs a
    lookup): lr multiplier, Muon momentum, batch, windows, tokens seen."""

    def __init__(self, config: tg.Hyperparameters):
        import train_gpt_medium as tg
        N = config.num_iterations
        self.lr = [tg.lr_schedule(s, config) for s in range(N + 1)]
        self.momentum = [tg.momentum_schedule(s, config) for s in range(N + 1)]
        self.batch = [tg.batch_tokens(s, config) for s in range(N + 1)]
        self.windows = [tg.attention_windows(s, config) for s in range(N + 1)]
        self.seen = [0]
        for s in range(N):
            self.seen.append(self.seen[-1] + self.batch[s])
        self.muon_lr, self.block = config.muon_lr, config.attn_block_size

    def window_fields(self, step: int) -> dict:
        long, short = self.windows[step]
        return dict(window_long_blocks=long, window_short_blocks=short, window_long_tokens=long * self.block,
                    window_short_tokens=short * self.block)


def memory_reader(device):
    """A function giving {memory_allocated_mib, peak_memory_mib}: the CUDA caching allocator's counters
    (host-side bookkeeping, no sync), or the CPU process's peak resident set size."""
    import resource
    import torch
    if torch.device(device).type == "cuda":
        return lambda: dict(memory_allocated_mib=round(torch.cuda.memory_allocated(device) / 2**20, 1),
                            peak_memory_mib=round(torch.cuda.max_memory_allocated(device) / 2**20, 1))
    return lambda: dict(peak_memory_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))


def run_record(config: tg.Hyperparameters, log_path: Optional[Path], device, world_size: int) -> dict:
    """The first record: what records/runlogs.py needs to group the run as it groups its log."""
    import train_gpt_medium as tg
    fields = dataclasses.fields(config)
    return dict(kind="run", step=0, format=FORMAT, log=str(log_path) if log_path else None,
                script=script_digest(tg.logged_source()), num_iterations=config.num_iterations,
                world_size=world_size, device=str(device), seed=config.seed, started=time.time(),
                config={f.name: repr(getattr(config, f.name)) for f in fields},
                config_groups={f.name: f.metadata["group"] for f in fields},
                experiment_groups=list(tg.EXPERIMENT_GROUPS))


class MetricsStream:
    """The log listener: each line it understands becomes a record, written to `path` (if any) and
    given to `tracker.log(record)` (if any)."""

    def __init__(self, config: tg.Hyperparameters, path: Optional[Path], device, world_size: int,
                 log_path: Optional[Path] = None, tracker=None, warn=None):
        import train_gpt_medium as tg
        self.config, self.tracker = config, tracker
        self.warn = warn or tg.say  # the run log's warn: stderr and the log
        self.schedule, self.memory = Schedule(config), memory_reader(device)
        if path is not None:
            from tools.cli import make_parent
            make_parent(path)  # a missing folder is made, as the log's
        self.file = open(path, "a", encoding="utf-8") if path is not None else None
        self.path, self.train_loss = path, None
        self.emit(run_record(config, log_path, device, world_size))

    def __call__(self, line: str) -> None:
        record = self.record_of(line)
        if record is not None:
            self.emit(record)

    def record_of(self, line: str) -> Optional[dict]:
        """The record of one log line, or None for a line that is not one (and for the step-0 loss line,
        kept for the next step record)."""
        if line.startswith("step:"):
            parsed = parse_step_line(line)
            if parsed is None:
                return None
            step, total, values = parsed
            ms, avg = float(values["train_time"][:-2]), float(values["step_avg"][:-2])
            if "val_loss" in values:
                bpb = values.get("val_bpb")
                return dict(kind="val", step=step, num_iterations=total, val_loss=float(values["val_loss"]),
                            val_bpb=float(bpb) if bpb is not None else None, train_time_ms=ms, step_avg_ms=avg,
                            tokens_seen=self.schedule.seen[step], **self.schedule.window_fields(step),
                            **self.memory())
            s, done = step - 1, self.schedule  # the step just trained
            record = dict(kind="step", step=step, num_iterations=total, train_time_ms=ms, step_avg_ms=avg,
                          lr_multiplier=done.lr[s], muon_lr=done.muon_lr * done.lr[s], muon_momentum=done.momentum[s],
                          batch_tokens=done.batch[s], tokens_seen=done.seen[step], **done.window_fields(s),
                          **self.memory())
            if self.train_loss is not None:
                record["train_loss"], self.train_loss = self.train_loss, None
            return record
        if line.startswith("step0_train_loss:"):
            self.train_loss = float(line.partition(":")[2])
            return None
        N = self.config.num_iterations
        if m := _FINAL.match(line):
            return dict(kind="final", step=N, val_loss=float(m[1]), perplexity=float(m[2]),
                        val_bpb=float(m[3]) if m[3] else None, package_time_ms=float(m[4]))
        if m := _PEAK.match(line):
            return dict(kind="peak_memory", step=N, allocated_mib=int(m[1]), reserved_mib=int(m[2]))
        if line.startswith("checkpoint: "):
            found = re.search(r"step_(\d+)$", line)
            return dict(kind="checkpoint", step=int(found[1]) if found else None, path=line.partition(": ")[2])
        if m := _RESUMED.match(line):
            return dict(kind="resume", step=int(m[2]), num_iterations=int(m[3]), checkpoint=m[1])
        if line.startswith(_ENDED):
            at = _AT_STEP.search(line)
            done = int(at[1]) if at else N if line.startswith(_ENDED + "finished") else 0
            return dict(kind="end", step=done, how=line[len(_ENDED):])
        return None

    def emit(self, record: dict) -> None:
        if self.file is not None:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as e:  # bookkeeping must not stop a record attempt: say it once, go on without it
                import train_gpt_medium as tg
                self.drop_file()  # first: the warning goes through the log, whose listener this stream is
                why = tg.write_failure(e, "--metrics_jsonl")
                self.warn(f"warning: --metrics_jsonl {self.path}: cannot write {why}; the metrics stream stops here, "
                          "the run goes on (its log has every line)")
        if self.tracker is not None and record["kind"] not in ("run", "end"):
            self.tracker.log(record)

    def drop_file(self) -> None:
        """Close the stream's file, a failing one included (its close may fail again: ignored)."""
        file, self.file = self.file, None
        try:
            file.close()
        except OSError:
            pass

    def close(self) -> None:
        if self.file is not None:
            self.drop_file()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


# ---- trackers: each imports its package when made, never before

def numbers(record: dict) -> dict[str, float]:
    """A record's numbers as `<kind>/<name>` (the tracker's keys), step and counts of steps left out."""
    return {f"{record['kind']}/{k}": float(v) for k, v in record.items()
            if k not in ("kind", "step", "num_iterations") and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


class WandbTracker:
    def __init__(self, config: tg.Hyperparameters, name: str, folder: Path):
        import wandb
        self.run = wandb.init(project="train_gpt_medium", name=name, dir=str(folder),
                              config=dataclasses.asdict(config))

    def log(self, record: dict) -> None:
        self.run.log(numbers(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class TensorboardTracker:
    def __init__(self, config: tg.Hyperparameters, name: str, folder: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(Path(folder) / "tensorboard" / name))
        self.writer.add_text("config", json.dumps(dataclasses.asdict(config), indent=1), 0)

    def log(self, record: dict) -> None:
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


TRACKERS = {"wandb": WandbTracker, "tensorboard": TensorboardTracker}


def make_tracker(config: tg.Hyperparameters, log_path: Path):
    return TRACKERS[config.tracker](config, log_path.stem, log_path.parent) if config.tracker != "none" else None


# ---- the cost of the stream per step line (a benchmark, run by hand: never inside a test)

def bench(lines: int, folder: Path) -> dict:
    """Microseconds per step line of the listener alone (parse, record, JSON, write and flush), on a
    tiny-preset config, against the same loop without a listener."""
    import train_gpt_medium as tg
    config = tg.make_config("tiny", num_iterations=max(lines, 2))
    stream = MetricsStream(config, Path(folder) / "bench.jsonl", "cpu", 1)
    text = [f"step:{s}/{config.num_iterations} train_time:{13 * s}ms step_avg:13.00ms" for s in range(1, lines + 1)]
    t0 = time.perf_counter()
    for line in text:
        stream(line)
    listener_s = time.perf_counter() - t0
    stream.close()
    t0 = time.perf_counter()
    for line in text:
        line.startswith("step:")  # the loop's own work per line, for scale
    bare_s = time.perf_counter() - t0
    return dict(lines=lines, us_per_line=1e6 * (listener_s - bare_s) / lines,
                bytes_per_line=(Path(folder) / "bench.jsonl").stat().st_size / (lines + 1))


def main(argv=None) -> int:
    import tempfile
    from tools.cli import OneLineParser
    parser = OneLineParser(__file__, description="the cost of the metrics stream per step line (see the docstring)")
    parser.add_argument("--bench", type=int, default=20000, metavar="LINES", help="step lines to feed (default: "
                        "%(default)s)")
    args = parser.parse_args(argv)
    if args.bench < 1:
        parser.error(f"--bench must be at least 1, got {args.bench}")
    with tempfile.TemporaryDirectory() as folder:
        result = bench(args.bench, Path(folder))
    print(f"metrics stream: {result['us_per_line']:.1f} us per step line ({result['lines']} lines, "
          f"{result['bytes_per_line']:.0f} bytes each), written and flushed line by line")
    return 0


if __name__ == "__main__":
    from tools.cli import run_main
    run_main(main)
