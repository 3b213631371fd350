"""The logging plugin: ``run.log`` writes structlog events, as JSON lines with run id, stage, step, level and
timestamp, to ``events.jsonl`` in the run directory (every event, whatever the terminal; the schema is in
``docs/events.md``), and to the console through the standard library logger ``csframework``.

On the console, csframework's messages and the user's own ``logging`` share one stream and format: under
the CLI, Hydra's job logging (``conf/hydra/job_logging/csframework.yaml``: stderr,
``[time][logger][LEVEL] - message``) governs both. From Python, records go to whatever handlers the user
configured; with none configured anywhere, the plugin writes the same format to stderr itself. Nothing is
configured globally, so importing csframework never touches the user's logging.

Each event's line is flushed to the OS as it is written, except a log's (``on_log_metrics``: the ``metrics``
event, the progress plugin's ``train`` or ``eval`` line, any other plugin's): those are held, and written and
flushed together when the log ends (``end_log``, after every other plugin's ``on_log_metrics``) at least
``WRITE_INTERVAL`` after the last such write, or before any other event's line, or when the run ends, fails
or stops. Logs that come faster than that (a small model's steps: a log every few milliseconds) are then
written a few dozen at a time, their code warm, where each alone cost about three times as much.
"""
from __future__ import annotations

import logging
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable

import structlog
from structlog.contextvars import get_contextvars

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
#: Seconds: the lines of logs that come sooner than this after the last write of log lines are held and
#: written together (at most this late, as tqdm redraws its bar at most every ``mininterval``): a log's code
#: then runs warm, once for many, where logs come faster than a human reads them (a small model's steps).
WRITE_INTERVAL = 0.1
#: ``logging``'s number of each level structlog names, one lookup where ``logging.getLevelName`` upper-cases
#: and looks up (a level not here, none structlog has today, still goes through it).
_LEVEL_NUMBERS = {name: getattr(logging, name.upper()) for name in ("debug", "info", "warning", "error", "critical")}


def console_line(event: dict) -> str:
    """An event as one console line: its name padded to 30 columns, then ``key=value`` sorted by key, a
    string quoted only when it has blanks, quotes or ``=``. This is the line structlog's
    ``ConsoleRenderer(colors=False)`` prints, written out because that renderer costs more than the rest of
    a log step together (it is built for colours and tracebacks, which these lines never have). Control
    characters (from a metric's name, a plugin's message, a file) are escaped: no forged or hidden lines."""
    # the shown keys picked and sorted in C: the comprehension's body runs once a shown field, with no test
    keys = sorted(event.keys() - _NOT_ON_CONSOLE)
    fields = " ".join([f"{key}={value if isinstance(value, str) and _QUOTED.isdisjoint(value) else repr(value)}"
                       for key, value in zip(keys, map(event.__getitem__, keys))])
    return printable(f"{str(event.get('event', '')):<30} {fields}".rstrip())


class ConsoleClock:
    """The time text of ``FORMAT``'s lines, as ``logging.Formatter.formatTime`` writes it (local time to the
    second, then ``,mmm``), its date and time converted once a second: ``time.localtime`` and ``strftime``
    cost more than the rest of a console line, and a log's two lines, a few milliseconds apart, share them."""

    def __init__(self, formatter: logging.Formatter):
        self.formatter = formatter
        self.second, self.text = -1, ""

    def at(self, created: float) -> str:
        """``created`` (a ``time.time()``) as ``FORMAT``'s time."""
        second = int(created)
        if second != self.second:
            formatter = self.formatter
            self.second, self.text = second, time.strftime(formatter.default_time_format,
                                                           formatter.converter(created))
        return f"{self.text},{int((created - second) * 1000):03d}"  # (LogRecord's msecs, as %03d formats them)


class LoggingPlugin:
    name = "logging"

    def __init__(self, stream=None):
        self.stream = stream
        self.file = None
        self.holding = False  # inside a log (on_log_metrics): its events' lines held (end_log)
        self.held: list[tuple[str, dict, bool, float]] = []  # (level, event, on_console, time)
        self.written = 0.0  # time.monotonic() of the last write of held lines
        #: (level, event, on_console): an event recorded (``run.log``'s processor); then its line written
        self.record: Callable[[str, dict, bool], None] = lambda *event: None
        self.write: Callable[[str, dict, bool, float], None] = lambda *line: None

    def _console(self) -> Callable[[str, str, float], None]:
        """``show(level, message, created)``: how a console line is shown. A record for the ``csframework`` logger when
        a handler is configured for it or a parent (the CLI's: Hydra's) and no ``stream`` was given; else the
        plugin's own handler's format, written to that stream (or stderr) and flushed."""
        logger = logging.getLogger(LOGGER)
        stream = self.stream or sys.stderr
        clear = "\r\x1b[K" if stream.isatty() else ""  # clears a progress bar drawn on this line
        if self.stream is None and logger.hasHandlers():
            def show(level: str, message: str, created: float) -> None:
                if clear:
                    stream.write(clear)
                number = _LEVEL_NUMBERS.get(level) or logging.getLevelName(level.upper())
                if logger.isEnabledFor(number):  # (as logger.log asks), a record with the event's own time: a
                    # held line (WRITE_INTERVAL) is shown with the time it was logged at, not when it is written
                    record = logger.makeRecord(LOGGER, number, __file__, 0, message, (), None, "show")
                    record.relativeCreated -= (record.created - created) * 1000
                    record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0  # (LogRecord's)
                    logger.handle(record)

            return show
        handler, formatter = logging.StreamHandler(stream), logging.Formatter(FORMAT)
        handler.setFormatter(formatter)
        clock = ConsoleClock(formatter)
        names = {name: logging.getLevelName(number) for name, number in _LEVEL_NUMBERS.items()}

        def own(level: str, message: str, created: float) -> None:
            # FORMAT's line, as the handler's formatter writes it (Formatter.format adds only a record's
            # exception and stack, none here), without a LogRecord: its set-up finds the caller's module and
            # the thread's and process's names, which FORMAT does not show (most of a console line's cost)
            try:
                stream.write(f"{clear}[{clock.at(created)}][{LOGGER}][{names[level]}] - {message}\n")
                stream.flush()
            except Exception:  # (a level structlog does not have, a closed stream): as logging does it
                number = _LEVEL_NUMBERS.get(level) or logging.getLevelName(level.upper())
                handler.handle(logger.makeRecord(LOGGER, number, __name__, 0, message, (), None))

        return own

    @hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        show = self._console()
        if run.rank == 0:  # a regular file of the run directory, never a planted link or FIFO
            self.file = run.files.append("events.jsonl")
        file, run_id = self.file, run.run_id

        def emit(_, level: str, event: dict):
            """``run.log``'s one processor: the run's context, the level and the time, then the line written
            and shown (inside a log, held: ``write_held``). The event gets the fields, in the order, that
            structlog's contextvars merge, our context, ``add_log_level`` and ``TimeStamper(fmt="iso",
            utc=True)`` gave it as four processors (a frame and a pass of structlog's loop each): the filtering
            logger's methods are named by their level (``warn`` is ``warning``, ``exception`` calls ``error``),
            and the time is the stamper's text."""
            record(level, event, event.pop("console", True))  # console False: events.jsonl only
            return ""  # (to ReturnLogger, which returns it: nothing else is done with it)

        def record(level: str, event: dict, on_console: bool) -> None:
            event.update(get_contextvars())  # a sweep job's job and sweep_dir
            event.setdefault("run_id", run_id)
            event.setdefault("stage", run.stage)
            event.setdefault("step", run.global_step)
            event["level"] = level
            if self.holding:  # a log's line: written with the log's others (end_log) or later (WRITE_INTERVAL)
                self.held.append((level, event, on_console, time.time()))
            else:
                if self.held:  # (in the order they came)
                    self.write_held()
                write(level, event, on_console, time.time())
                if file is not None and not file.closed:
                    file.flush()  # on disk (with the OS) before the next step: what a crash leaves is complete

        def write(level: str, event: dict, on_console: bool, created: float) -> None:
            event["timestamp"] = datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")
            if file is not None and not file.closed:  # after the run, run.log still reaches the console
                try:
                    line = dumps(event)  # strict JSON
                except TypeError as e:  # a value JSON cannot hold: named with its event (made only then)
                    raise TypeError(f"event {event.get('event')!r}: {e}") from None
                file.write(line + "\n")
            if on_console and run.rank == 0:
                show(level, console_line(event), created)

        self.record, self.write = record, write
        # the bound logger itself, not the lazy proxy wrap_logger returns: the proxy looks up the logger
        # again for every event (its __getattr__), and without caching binds a new one each time. The event is
        # written by emit, which hands structlog's final logger an empty line (ReturnLogger: it returns it)
        # rather than raising DropEvent, an exception a line
        run.log = structlog.wrap_logger(structlog.ReturnLogger(), processors=[emit], wrapper_class=RunLogger).bind()
        run.log.info(f"{run.mode}_start", output_dir=str(run.output_dir), device_type=run.device_type,
                     stages=[name for name, _ in run.stages], **run.distribution,
                     param_groups=[group.summary() for group in getattr(run, "param_groups", ())])

    @hookimpl
    def on_log_metrics(self, run, metrics, step):
        """Metrics go to events.jsonl only; the progress plugin shows them on the console. A log begins here
        (this plugin's call comes before the other built-ins'): its lines are held until ``end_log``."""
        self.holding = True
        # the event run.log.info("metrics", console=False, step=step, **metrics) makes, without structlog's
        # way through its bound logger (a log's cost): run.log is this plugin's, with no context bound
        self.record("info", {"step": step, **metrics, "event": "metrics"}, False)

    @hookimpl(trylast=True, specname="on_log_metrics")
    def end_log(self):
        """A log ends (after the other plugins' ``on_log_metrics``): its events' lines are written and go to
        the OS in one write and flush, where each was one; when the last write was less than
        ``WRITE_INTERVAL`` ago they wait for the next log's (or any other event, or the run's end). Should a
        plugin raise in between, the run fails and ``on_exception`` writes them."""
        self.holding = False
        if self.held and time.monotonic() - self.written >= WRITE_INTERVAL:
            self.write_held()

    @hookimpl
    def on_checkpoint_save(self, run, state):
        """The lines held are written before the checkpoint is (as ``metrics.csv``'s rows): a run killed after
        it and resumed from it does not log those steps again."""
        if self.held:
            self.write_held()

    def write_held(self) -> None:
        """Write the held lines of the logs so far, in order, and flush them to the OS."""
        held, self.held = self.held, []
        for line in held:
            self.write(*line)
        if self.file is not None and not self.file.closed:
            self.file.flush()
        self.written = time.monotonic()

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
        self.holding = False
        if self.held:
            self.write_held()
        if self.file is not None:
            self.file.close()  # (writes what a log interrupted by an error held)
            self.file = None


class RunLogger(structlog.make_filtering_bound_logger(logging.INFO)):  # type: ignore[misc]
    """``run.log``'s class: structlog's filtering bound logger at level info (its methods, ``bind``, ``new``,
    ``unbind``), whose one processor (the logging plugin's) is called directly, as structlog's custom wrappers
    may: the event it builds (the bound context, the keywords, then ``event``) without
    ``_process_event``'s pass over a chain of one and the final logger's call (each log's ``train`` line, on
    a small model's steps, paid a few microseconds a step for them)."""

    def _proxy_to_logger(self, method_name: str, event: str | None = None, **event_kw: Any) -> Any:
        event_kw["event"] = event
        return self._processors[0](self._logger, method_name, {**self._context, **event_kw})


def quiet_logger() -> Any:
    """A run's logger until this plugin sets one up (``on_fit_start``): warnings and errors to stderr,
    nothing else."""
    return structlog.wrap_logger(
        structlog.PrintLogger(file=None),
        processors=[structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(30),
    )
