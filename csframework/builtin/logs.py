"""The logging plugin: ``run.log`` writes structlog events to the console and, as JSON lines with run id,
stage and step, to ``events.jsonl`` in the run directory. Nothing is configured globally: the logger is
the run's own, so importing csframework never touches the user's logging."""
from __future__ import annotations

import json
import sys

import structlog

from ..hookspecs import hookimpl


class LoggingPlugin:
    name = "logging"

    def __init__(self, stream=None):
        self.stream = stream
        self.file = None

    @hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        stream = self.stream or sys.stderr
        tty = stream.isatty()
        console = structlog.dev.ConsoleRenderer(colors=tty)
        if run.rank == 0:
            run.output_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(run.output_dir / "events.jsonl", "a", encoding="utf-8")
        file = self.file

        def context(_, __, event: dict) -> dict:
            event.update(structlog.contextvars.get_contextvars())  # a sweep job's job and sweep_dir
            event.setdefault("run_id", run.run_id)
            event.setdefault("stage", run.stage)
            event.setdefault("step", run.global_step)
            return event

        def emit(_, __, event: dict):
            if file is not None and not file.closed:  # after the run, run.log still reaches the console
                file.write(json.dumps(event, default=str) + "\n")
                file.flush()
            if run.rank == 0:
                line = console(None, None, {k: v for k, v in event.items() if k not in ("run_id", "sweep_dir")})
                stream.write(("\r\x1b[K" if tty else "") + line + "\n")
                stream.flush()
            raise structlog.DropEvent

        run.log = structlog.wrap_logger(
            None, processors=[context, structlog.processors.add_log_level,
                              structlog.processors.TimeStamper(fmt="iso", utc=True), emit],
            wrapper_class=structlog.make_filtering_bound_logger(20))
        run.log.info("fit_start", output_dir=str(run.output_dir), device_type=run.device_type,
                     stages=[name for name, _ in run.stages], resumed_at=run.global_step or None)

    @hookimpl
    def on_log_metrics(self, run, metrics, step):
        """Metrics go to events.jsonl only; the progress plugin shows them on the console."""
        if self.file is not None:
            event = {"event": "metrics", "run_id": run.run_id, **structlog.contextvars.get_contextvars(),
                     "stage": run.stage, "step": step, **metrics}
            self.file.write(json.dumps(event) + "\n")
            self.file.flush()

    @hookimpl(trylast=True)  # after every other plugin's on_fit_end, which may still log
    def on_fit_end(self, run):
        run.log.info("fit_end", status=run.status, **{k: round(v, 5) for k, v in run.metrics.items()})
        self._close()

    @hookimpl(trylast=True)
    def on_exception(self, run, error):
        run.log.error("fit_failed" if run.status == "failed" else "fit_interrupted",
                      error=f"{type(error).__name__}: {error}")
        self._close()

    def _close(self):
        if self.file is not None:
            self.file.close()
            self.file = None
