"""The progress plugin: on a terminal, a bar with loss and steps/s redrawn in place; otherwise a log line
whenever training metrics are logged (``loop.log_every``) and after each evaluation. The ``train`` event
reaches ``events.jsonl`` either way (on a terminal, the bar shows it instead of the console)."""
from __future__ import annotations

import sys
import time

from ..hookspecs import hookimpl


class ProgressPlugin:
    name = "progress"

    def __init__(self, stream=None, min_interval: float = 0.1):
        self.stream = stream
        self.min_interval = min_interval
        self.tty = False
        self.total = None
        self.loss = None
        self.last_draw = 0.0
        self.start = (0.0, 0)

    @hookimpl
    def on_train_start(self, run):
        self.stream = self.stream or sys.stderr
        self.tty = self.stream.isatty() and run.rank == 0
        self.total = run.global_step - run.stage_step + run.total_steps(run.stage_config)
        self.start = (time.perf_counter(), run.global_step)

    @hookimpl
    def on_train_batch_end(self, run):
        if self.tty and time.perf_counter() - self.last_draw >= self.min_interval:
            self._draw(run)

    @hookimpl
    def on_log_metrics(self, run, metrics, step):
        if "train/loss" in metrics:
            self.loss = metrics["train/loss"]
            run.log.info("train", progress=f"{step}/{self.total}", loss=round(self.loss, 4), console=not self.tty,
                         lr=float(f"{metrics['lr']:.4g}"), steps_per_sec=round(metrics["steps_per_sec"], 1))
        elif any(k.startswith("val/") for k in metrics):
            run.log.info("eval", **{k: round(v, 4) for k, v in metrics.items()})

    @hookimpl
    def on_train_end(self, run):
        if self.tty:
            self._draw(run)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, run):
        now = time.perf_counter()
        self.last_draw = now
        done = run.global_step
        rate = (done - self.start[1]) / max(now - self.start[0], 1e-9)
        width = 30
        filled = int(width * min(done / max(self.total, 1), 1.0))
        loss = f" loss {self.loss:.4f}" if self.loss is not None else ""
        self.stream.write(f"\r[{run.stage}] |{'#' * filled}{'.' * (width - filled)}| {done}/{self.total}"
                          f"{loss} {rate:.1f} steps/s\x1b[K")
        self.stream.flush()
