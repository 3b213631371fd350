"""The logging plugin: ``run.log`` writes structlog events, as JSON lines with run id, stage, step, level and
timestamp, to ``events.jsonl`` in the run directory (every event, whatever the terminal; the schema is in
``docs/events.md``), and to the console through the standard library logger ``csframework``.

On the console, csframework's messages and the user's own ``logging`` share one stream and format: under
the CLI, Hydra's job logging (``conf/hydra/job_logging/csframework.yaml``: stderr,
``[time][logger][LEVEL] - message``) governs both. From Python, records go to whatever handlers the user
configured; with none configured anywhere, the plugin writes the same format to stderr itself. Nothing is
configured globally, so importing csframework never touches the user's logging.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from ..errors import printable
from ..failures import error_record
from ..hookspecs import hookimpl
from ..jsonout import dumps

#: One console format for csframework and everything else under the CLI (also in the job-logging config).
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
LOGGER = "csframework"
#: Keys of an event that the console line leaves out (the format shows time and level; the name comes first).
_NOT_ON_CONSOLE = frozenset(("run_id", "timestamp", "level", "sweep_dir", "event"))
_QUOTED = frozenset(" \t=\r\n\"'")
#: ``logging``'s number of each level structlog names, one lookup where ``logging.getLevelName`` upper-cases
#: and looks up (a level not here, none structlog has today, still goes through it).
_LEVEL_NUMBERS = {name: getattr(logging, name.upper()) for name in ("debug", "info", "warning", "error", "critical")}


def console_line(event: dict) -> str:
    """An event as one console line: its name padded to 30 columns, then ``key=value`` sorted by key, a
    string quoted only when it has blanks, quotes or ``=``. This is the line structlog's
    ``ConsoleRenderer(colors=False)`` prints, written out because that renderer costs more than the rest of
    a log step together (it is built for colours and tracebacks, which these lines never have). Control
    characters (from a metric's name, a plugin's message, a file) are escaped: no forged or hidden lines."""
    # one comprehension over the sorted items (no per-key branch, lookup and append in the loop's body)
    fields = " ".join([f"{key}={value if isinstance(value, str) and _QUOTED.isdisjoint(value) else repr(value)}"
                       for key, value in sorted(event.items()) if key not in _NOT_ON_CONSOLE])
    return printable(f"{str(event.get('event', '')):<30} {fields}".rstrip())


class LoggingPlugin:
    name = "logging"

    def __init__(self, stream=None):
        self.stream = stream
        self.file = None

    def _console(self):
        """``(logger, handler)``: where console records go. A handler of our own only for an explicit
        ``stream``, or when no handler is configured for the ``csframework`` logger or any of its parents."""
        logger = logging.getLogger(LOGGER)
        if self.stream is None and logger.hasHandlers():
            return logger, None
        handler = logging.StreamHandler(self.stream or sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        return logger, handler

    @hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        logger, handler = self._console()
        tty = (self.stream or sys.stderr).isatty()
        if run.rank == 0:  # a regular file of the run directory, never a planted link or FIFO
            self.file = run.files.append("events.jsonl")
        file = self.file

        def context(_, __, event: dict) -> dict:
            event.update(structlog.contextvars.get_contextvars())  # a sweep job's job and sweep_dir
            event.setdefault("run_id", run.run_id)
            event.setdefault("stage", run.stage)
            event.setdefault("step", run.global_step)
            return event

        def emit(_, __, event: dict):
            on_console = event.pop("console", True)  # False: events.jsonl only (what a progress bar shows)
            if file is not None and not file.closed:  # after the run, run.log still reaches the console
                file.write(dumps(event, where=f"event {event.get('event')!r}") + "\n")  # strict JSON
                file.flush()  # on disk (with the OS) before the next step: what a crash leaves is complete
            if run.rank == 0 and on_console:
                level = event["level"]
                number = _LEVEL_NUMBERS.get(level) or logging.getLevelName(level.upper())
                message = console_line(event)
                if tty:  # clear a progress bar drawn on this line
                    (self.stream or sys.stderr).write("\r\x1b[K")
                if handler is None:
                    logger.log(number, message)
                else:
                    handler.handle(logger.makeRecord(LOGGER, number, __name__, 0, message, (), None))
            raise structlog.DropEvent

        # the bound logger itself, not the lazy proxy wrap_logger returns: the proxy looks up the logger
        # again for every event (its __getattr__), and without caching binds a new one each time
        run.log = structlog.wrap_logger(
            None, processors=[context, structlog.processors.add_log_level,
                              structlog.processors.TimeStamper(fmt="iso", utc=True), emit],
            wrapper_class=structlog.make_filtering_bound_logger(20)).bind()
        run.log.info(f"{run.mode}_start", output_dir=str(run.output_dir), device_type=run.device_type,
                     stages=[name for name, _ in run.stages], **run.distribution,
                     param_groups=[group.summary() for group in getattr(run, "param_groups", ())])

    @hookimpl
    def on_log_metrics(self, run, metrics, step):
        """Metrics go to events.jsonl only; the progress plugin shows them on the console."""
        run.log.info("metrics", console=False, step=step, **metrics)

    @hookimpl(trylast=True)  # after every other plugin's on_fit_end, which may still log
    def on_fit_end(self, run):
        run.log.info(f"{run.mode}_end", status=run.status, **{k: round(v, 5) for k, v in run.metrics.items()})
        self._close()

    @hookimpl(trylast=True)
    def on_exception(self, run, error):
        """A failure at error level; an interruption (a signal, Ctrl-C) is expected: warning level. In
        ``events.jsonl`` only: the exception goes on to whoever called the run, which reports it in one line
        (the CLI's ``csframework: error:``, a sweep's ``job N failed``) or raises it (Python)."""
        error = error_record(run, error)
        if run.status == "failed":
            run.log.error(f"{run.mode}_failed", error=error, console=False)
        else:
            run.log.warning(f"{run.mode}_interrupted", error=error, console=False)
        self._close()

    def _close(self):
        if self.file is not None:
            self.file.close()
            self.file = None


def quiet_logger() -> Any:
    """A run's logger until this plugin sets one up (``on_fit_start``): warnings and errors to stderr,
    nothing else."""
    return structlog.wrap_logger(
        structlog.PrintLogger(file=None),
        processors=[structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(30),
    )
