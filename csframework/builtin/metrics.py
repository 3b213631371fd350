"""The metrics plugin: every reported metric as a row of ``metrics.csv`` (``step,stage,name,value``), and,
when the run ends, fails or stops, ``summary.json`` (status, global step, device type, final metrics) and
``curves.svg`` (train and validation loss)."""
from __future__ import annotations

import csv

from ..files import write_json_atomic
from ..hookspecs import hookimpl
from .plot import write_curves


class MetricsPlugin:
    name = "metrics"

    def __init__(self):
        self.file = None
        self.writer = None

    @hookimpl
    def on_fit_start(self, run):
        if run.rank != 0:
            return
        run.output_dir.mkdir(parents=True, exist_ok=True)
        path = run.output_dir / "metrics.csv"
        new = not path.exists() or path.stat().st_size == 0
        self.file = open(path, "a", newline="", encoding="utf-8")
        self.writer = csv.writer(self.file)
        if new:
            self.writer.writerow(["step", "stage", "name", "value"])

    @hookimpl
    def on_log_metrics(self, run, metrics, step):
        if self.writer is not None:
            self.writer.writerows([step, run.stage, name, value] for name, value in metrics.items())
            self.file.flush()

    @hookimpl
    def on_fit_end(self, run):
        self._finish(run)

    @hookimpl
    def on_exception(self, run, error):
        self._finish(run, error)

    def _finish(self, run, error=None):
        if self.file is not None:
            self.file.close()
            self.file = self.writer = None
        if run.rank != 0:
            return
        summary = run.summary()
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}"
        run.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run.output_dir / "summary.json", summary)
        write_curves(run.output_dir, title=f"{run.run_id} ({summary['status']})")
