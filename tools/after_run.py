"""What the trainer does for --metrics_jsonl, --tracker and --eval_hellaswag (train_gpt_medium.py's
after_run_hooks makes one AfterRun on rank 0, before anything is built).

- Now (before training): the metrics file and the tracker's package are checked, and the HellaSwag
  items are read (from --hellaswag_file or the hub's cache) and tokenized, so that what cannot be
  had is an error before the run, not after it.
- attach: the metrics stream (tools/metrics.py) listens to the run log from its first line on.
- evaluate: after train() has returned (its clock stopped for good), HellaSwag on the final model
  at its last step, one log line `hellaswag: ...` after the record's closing lines, and a record.
  An error there (out of memory, say) becomes that line, `hellaswag: not scored (...)`: the run
  itself is done and logged, and still exits 0.
- close: the stream's file and the tracker.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import train_gpt_medium as tg


class AfterRun:
    def __init__(self, config: tg.Hyperparameters):
        from tools import hellaswag, metrics
        self.config, self.stream = config, None
        metrics.check_request(config)
        self.items = hellaswag.prepare(config) if config.eval_hellaswag else None

    def attach(self, log: tg.RunLog, device, world_size: int) -> None:
        from tools import metrics
        cfg = self.config
        if log.path is None or not (cfg.metrics_jsonl or cfg.tracker != "none"):
            return
        self.stream = metrics.MetricsStream(cfg, metrics.metrics_path(cfg, Path(log.path)), device, world_size,
                                            log.path, metrics.make_tracker(cfg, Path(log.path)), warn=log.warn)
        log.listeners.append(self.stream)

    def evaluate(self, result: dict, device, log: tg.RunLog) -> None:
        from tools import hellaswag
        if self.items is None:
            return
        t0 = time.perf_counter()
        try:
            scores = hellaswag.evaluate(result["model"], self.config, self.config.num_iterations, self.items)
        except Exception as e:  # out of memory, say: the run itself is done and logged, so it still ends well
            log.write(f"hellaswag: not scored ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''})")
            return
        seconds = time.perf_counter() - t0
        if self.stream is not None:  # the full-precision numbers (the line rounds them)
            self.stream.emit(dict(kind="hellaswag", **scores, eval_time_s=seconds))
        log.write(hellaswag.result_line(scores, seconds))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
