"""``csframework.builtin.logs``, the logging plugin.

The events schema (issue 14, item 5): every event of a fit, a resumed fit, a validate, a CSX compile, a
failed and an interrupted run matches the table in docs/events.md, which names every event the code logs;
``events.jsonl`` is the same whatever the terminal.

The plugin writes console lines itself (``console_line``) instead of through structlog's ``ConsoleRenderer``,
which costs more than the rest of a log step: the text must stay the renderer's."""
from __future__ import annotations

import io
import json
import logging
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog

import csframework as csf
import fixtures
from fixtures import PoisonAt, StopAt, events
from csframework.builtin.logs import FORMAT, LOGGER, WRITE_INTERVAL, LoggingPlugin, RunLogger, console_line
from csframework.builtin.progress import ProgressPlugin

ROOT = Path(__file__).resolve().parents[2]
COMMON = {"event": "str", "level": "str", "timestamp": "str", "run_id": "str", "stage": "str", "step": "int"}
TYPES = {"str": (str,), "int": (int,), "float": (int, float), "list": (list,), "bool": (bool,)}


def documented() -> dict[str, tuple[str, dict[str, str]]]:
    """``{event: (level, {field: type})}`` from the table of docs/events.md."""
    schema = {}
    for line in (ROOT / "docs" / "events.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[1] in ("info", "warning", "error"):
            fields = dict(re.findall(r"`([\w*?/]+): (\w+)`", cells[2]))
            schema[cells[0].strip("`")] = (cells[1], fields)
    return schema


SCHEMA = documented()


def problems_of(event: dict) -> list[str]:
    name = event.get("event")
    if name not in SCHEMA:
        return [f"{name}: not in docs/events.md"]
    level, fields = SCHEMA[name]
    expected = dict(COMMON, **{k.rstrip("?"): t for k, t in fields.items() if k != "*"})
    found = []
    if event.get("level") != level:
        found.append(f"{name}: level {event.get('level')}, documented {level}")
    for key, kind in expected.items():
        optional = f"{key}?" in fields
        if key not in event:
            if not optional:
                found.append(f"{name}: no {key}")
        elif isinstance(event[key], bool) and kind != "bool" or not isinstance(event[key], TYPES[kind]):
            found.append(f"{name}: {key} is {event[key]!r}, documented {kind}")
    for key in set(event) - set(expected):
        if "*" not in fields:
            found.append(f"{name}: undocumented field {key}")
        elif isinstance(event[key], bool) or not isinstance(event[key], TYPES[fields["*"]]):
            found.append(f"{name}: {key} is {event[key]!r}, documented {fields['*']}")
    return found


def test_the_doc_names_every_event_the_code_logs():
    logged = set()
    for path in (ROOT / "csframework").rglob("*.py"):
        for name in re.findall(r"\blog\.(?:info|warning|error)\(\s*f?\"([\w{}.]+)\"", path.read_text()):
            for mode in ("fit", "validate", "test", "predict"):  # run.mode's values
                logged.add(name.replace("{run.mode}", mode))
    assert logged, "no log calls found"
    assert logged <= set(SCHEMA), f"undocumented: {sorted(logged - set(SCHEMA))}"
    assert set(SCHEMA) <= logged, f"documented but never logged: {sorted(set(SCHEMA) - logged)}"


def test_every_event_of_fit_validate_csx_failure_and_interrupt_matches_the_schema(tmp_path):
    runs = {}
    fit = tmp_path / "fit"
    csf.Run(fixtures.compose("loop.max_steps=4", "loop.eval_every=2", "checkpoint.every_steps=2",
                             "optimizer.schedule.warmup_steps=10"), output_dir=fit).fit()
    runs["fit"] = events(fit)
    csf.Run(fixtures.compose("loop.max_steps=6", "checkpoint.resume=auto"), output_dir=fit).fit()
    runs["resumed"] = events(fit)[len(runs["fit"]):]
    validate = tmp_path / "validate"
    csf.Run(fixtures.compose("mode=validate", f"checkpoint.resume={fit}"), output_dir=validate).validate()
    runs["validate"] = events(validate)
    test_set = ["+data.test._target_=fixtures.Blobs", "+data.test.n=16"]
    tested = tmp_path / "tested"
    csf.Run(fixtures.compose(*test_set, "loop.max_steps=2", "loop.eval_every=1",
                             "checkpoint.keep_best.monitor=val/loss"), output_dir=tested).fit()
    runs["tested"] = events(tested)
    test = tmp_path / "test"
    csf.Run(fixtures.compose(*test_set, "mode=test", f"checkpoint.resume={tested}"), output_dir=test).test()
    runs["test"] = events(test)
    predict = tmp_path / "predict"
    csf.Run(fixtures.compose("+data.predict._target_=fixtures.Blobs", "+data.predict.n=8", "mode=predict",
                             f"checkpoint.resume={tested}"), output_dir=predict).predict()
    runs["predict"] = events(predict)
    csx = tmp_path / "csx"
    csf.Run(fixtures.compose("device=csx", "loop.max_steps=2"), output_dir=csx).fit()
    runs["csx"] = events(csx)
    compile_only = tmp_path / "compile_only"
    csf.Run(fixtures.compose("device=csx", "backend.compile_only=true"), output_dir=compile_only).fit()
    runs["compile_only"] = events(compile_only)
    stopped = tmp_path / "stopped"
    with pytest.raises(csf.Interrupted):
        csf.Run(fixtures.compose("loop.max_steps=6"), plugins=[StopAt(2)], output_dir=stopped).fit()
    runs["interrupted"] = events(stopped)
    failed = tmp_path / "failed"
    with pytest.raises(csf.NonFiniteLossError):
        csf.Run(fixtures.compose("loop.max_steps=6"), plugins=[PoisonAt(2)], output_dir=failed).fit()
    runs["failed"] = events(failed)

    names = {kind: [e["event"] for e in found] for kind, found in runs.items()}
    assert names["fit"][0] == "fit_start" and names["fit"][-1] == "fit_end"
    assert {"train", "metrics", "eval", "checkpoint_saved", "warmup_longer_than_training"} <= set(names["fit"])
    assert names["resumed"][:2] == ["fit_start", "resumed"]
    assert names["validate"][:2] == ["validate_start", "resumed"] and names["validate"][-1] == "validate_end"
    assert not any(n.startswith("fit_") for n in names["validate"])
    assert names["tested"][-2:] == ["tested", "fit_end"]
    assert names["test"][:2] == ["test_start", "resumed"] and names["test"][-1] == "test_end"
    assert names["predict"][-2:] == ["predictions_written", "predict_end"]
    assert "compiled" in names["csx"] and "compile_only" in names["compile_only"]
    assert names["interrupted"][-1] == "fit_interrupted" and runs["interrupted"][-1]["level"] == "warning"
    assert names["failed"][-1] == "fit_failed" and runs["failed"][-1]["level"] == "error"
    assert "resumed_at" not in runs["fit"][0]
    problems = [f"{kind}: {p}" for kind, found in runs.items() for e in found for p in problems_of(e)]
    assert not problems, "\n".join(problems)


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "tty"])
def test_events_jsonl_is_the_same_on_a_terminal(tmp_path, terminal):
    stream = Terminal() if terminal else io.StringIO()
    logging_plugin, progress_plugin = LoggingPlugin(stream=stream), ProgressPlugin(stream=stream)
    logging_plugin.name, progress_plugin.name = "logging_under_test", "progress_under_test"
    cfg = fixtures.compose("loop.max_steps=4", "loop.eval_every=2", "plugins.disable=[logging,progress]")
    csf.Run(cfg, plugins=[logging_plugin, progress_plugin], output_dir=tmp_path).fit()
    names = [e["event"] for e in events(tmp_path)]
    assert names.count("train") == 2 and names.count("metrics") == 4  # train x2, eval x2 (steps 2 and 4)
    console = stream.getvalue()
    assert ("train " in console) is not terminal  # on a terminal the bar shows it instead
    assert "][csframework][INFO] - fit_start" in console


@pytest.mark.parametrize("event", [
    {"event": "train", "progress": "25/100", "loss": 0.1234, "lr": 0.001, "steps_per_sec": 1234.5},
    {"event": "fit_start", "output_dir": "/tmp/a b", "stages": ["main"], "device_type": "CPU"},
    {"event": "x" * 40, "quote": "it's", "eq": "a=b", "empty": "", "none": None, "nested": {"a": [1, 2.5]}},
    {"event": "eval"},
], ids=["train", "blank-and-list", "quoting", "no-fields"])
def test_console_line_is_what_structlogs_console_renderer_prints(event):
    assert console_line(dict(event)) == structlog.dev.ConsoleRenderer(colors=False)(None, None, dict(event))


def test_console_line_leaves_out_what_the_log_format_shows():
    line = console_line({"event": "train", "loss": 0.5, "run_id": "r", "timestamp": "t", "level": "info",
                         "sweep_dir": "/s"})
    assert line == console_line({"event": "train", "loss": 0.5}) and "run_id" not in line


class OnDiskAtStepStart:
    """At the start of each step, what another reader finds in events.jsonl and metrics.csv."""

    def __init__(self):
        self.seen: dict[int, tuple[list[dict], list[str]]] = {}

    @csf.hookimpl
    def on_train_batch_start(self, run):
        with open(run.output_dir / "events.jsonl") as events_file, open(run.output_dir / "metrics.csv") as rows:
            self.seen[run.global_step] = ([json.loads(line) for line in events_file], rows.read().splitlines())


class SlowSteps:
    """Steps that take ``WRITE_INTERVAL``: each log comes that long after the last write, as a model's do."""

    name = "slow_steps"

    @csf.hookimpl
    def on_train_step_end(self):
        time.sleep(WRITE_INTERVAL)


def test_a_logs_lines_are_with_the_os_when_the_next_step_starts(tmp_path):
    """The durability a log keeps when logs come no faster than ``WRITE_INTERVAL`` (its lines flushed at its
    end, not when a buffer fills or the run ends): a crash in the next step leaves the log's events and rows
    in the files."""
    reader = OnDiskAtStepStart()
    csf.Run(fixtures.compose("loop.max_steps=6", "loop.log_every=2"), plugins=[reader, SlowSteps()],
            output_dir=tmp_path).fit()
    for step in (2, 4):
        found, rows = reader.seen[step]
        assert {(e["event"], e["step"]) for e in found} >= {("train", step), ("metrics", step)}
        assert [row.split(",")[:3] for row in rows if row.startswith(f"{step},")] == [
            [str(step), "main", name] for name in ("train/loss", "train/accuracy", "lr", "steps_per_sec")]


def test_logs_that_come_sooner_are_held_then_written_in_order_with_their_own_times(tmp_path, monkeypatch):
    """A log ``WRITE_INTERVAL`` or more after the last write is written and flushed at its end; the lines of
    sooner ones are held: written, in the order they came, with the next such log, before any other event's
    line and when the run ends, each stamped with the time it was logged at."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    run, plugin = bare_run(tmp_path, []), LoggingPlugin(stream=io.StringIO())
    plugin.on_fit_start(run)

    def log(step):
        plugin.on_log_metrics(run, {"train/loss": 0.5}, step)
        run.log.info("train", step=step, console=False)  # the progress plugin's line
        plugin.end_log()

    def on_disk():
        return [(e["event"], e["step"]) for e in events(tmp_path)]

    log(1)  # the first: written at its end
    assert on_disk()[-2:] == [("metrics", 1), ("train", 1)]
    clock[0] += WRITE_INTERVAL / 2
    log(2)
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: 1_700_000_000.25)
        log(3)
    assert on_disk()[-1] == ("train", 1)  # held
    clock[0] += WRITE_INTERVAL
    log(4)  # the interval has passed: the held lines, then its own
    assert on_disk()[-6:] == [("metrics", 2), ("train", 2), ("metrics", 3), ("train", 3), ("metrics", 4),
                              ("train", 4)]
    assert [e["timestamp"] for e in events(tmp_path) if e["step"] == 3] == ["2023-11-14T22:13:20.250000Z"] * 2
    log(5)
    run.log.warning("slow")  # any other event: the held lines first
    assert on_disk()[-3:] == [("metrics", 5), ("train", 5), ("slow", 7)]
    log(6)
    plugin._close()  # the run's end (on_fit_end), an error or a stop (on_exception)
    assert on_disk()[-2:] == [("metrics", 6), ("train", 6)]


def test_a_held_line_reaches_a_configured_handler_with_the_time_it_was_logged_at(tmp_path, monkeypatch, request):
    """Under a handler the user (or the CLI's Hydra logging) configured, a held console line's record carries
    the time its event was logged at, as ``events.jsonl``'s line does, not the later time it was written."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(LOGGER)
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "disabled", False)  # (an earlier test's Hydra logging set-up may disable it)
    level = logger.level
    logger.setLevel(logging.INFO)  # (setLevel, not the attribute: it clears the loggers' cached answers)
    request.addfinalizer(lambda: logger.setLevel(level))
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    run, plugin = bare_run(tmp_path, []), LoggingPlugin()  # no stream: the configured handler shows the lines
    plugin.on_fit_start(run)
    for step, now in ((1, 1_700_000_000.25), (2, 1_700_000_003.5)):  # the first written, the second held
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda: now)
            plugin.on_log_metrics(run, {"train/loss": 0.5}, step)
            run.log.info("train", step=step)
            plugin.end_log()
    assert [r.getMessage().split()[0] for r in records][-1] == "train" and len(plugin.held) == 2
    plugin._close()
    shown = [r for r in records if r.getMessage().startswith("train")]
    assert [(r.created, r.msecs) for r in shown] == [(1_700_000_000.25, 250.0), (1_700_000_003.5, 500.0)]
    assert shown[1].relativeCreated - shown[0].relativeCreated == pytest.approx(3250.0)  # moved with it


def test_an_event_has_the_fields_and_order_structlogs_processors_gave_it(tmp_path):
    """``run.log``'s one processor does what the chain it replaced did (the run's context, a sweep job's
    context variables, ``add_log_level``, ``TimeStamper(fmt="iso", utc=True)``): the same fields in the
    same order, the level's name mapped as structlog maps it, the console record at that level."""
    stream = io.StringIO()
    run = SimpleNamespace(rank=0, run_id="r1", stage="main", global_step=7, mode="fit", output_dir=tmp_path,
                          device_type="CPU", stages=[("main", None)], distribution={},
                          files=SimpleNamespace(append=lambda name: open(tmp_path / name, "a")))
    plugin = LoggingPlugin(stream=stream)
    plugin.on_fit_start(run)
    with structlog.contextvars.bound_contextvars(job=3):
        run.log.warning("slow", seconds=1.5, console=True)
    run.log.info("quiet", console=False)
    plugin._close()
    start, slow, quiet = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert list(slow) == ["seconds", "event", "job", "run_id", "stage", "step", "level", "timestamp"]
    assert slow | {"timestamp": None} == {"seconds": 1.5, "event": "slow", "job": 3, "run_id": "r1",
                                          "stage": "main", "step": 7, "level": "warning", "timestamp": None}
    stamped = structlog.processors.TimeStamper(fmt="iso", utc=True)(None, "info", {})["timestamp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", slow["timestamp"]) and len(stamped) == len(
        slow["timestamp"]) and slow["timestamp"] <= quiet["timestamp"] <= stamped
    assert start["event"] == "fit_start" and quiet["level"] == "info" and "job" not in quiet
    assert "][csframework][WARNING] - slow" in stream.getvalue() and "quiet" not in stream.getvalue()


def test_run_log_gives_its_processor_the_event_structlogs_own_bound_logger_gives(tmp_path):
    """``RunLogger`` calls the processor itself: what it hands it (bound context, keywords, ``event``, in that
    order; ``%`` arguments; ``exception``'s ``exc_info``; levels below info dropped) is what structlog's
    filtering bound logger at info hands the same processor, and so is what the call returns."""
    def logged(wrapper_class) -> list:
        seen = []

        def processor(_, method_name, event):
            seen.append((method_name, dict(event), list(event)))
            return ""
        log = structlog.wrap_logger(structlog.ReturnLogger(), processors=[processor], wrapper_class=wrapper_class)
        bound = log.bind(job=1, event="bound")
        returned = [log.info("plain", a=1, b=2), bound.warning("args %s-%d", "x", 3, c=3), bound.debug("dropped"),
                    bound.unbind("job").error("unbound"), log.new(z=0).critical("new")]
        try:
            raise ValueError("boom")
        except ValueError:
            returned.append(log.exception("failed", d=4))
        return seen + returned

    assert logged(RunLogger) == logged(structlog.make_filtering_bound_logger(logging.INFO))


class CountedFlushes(io.TextIOWrapper):
    """An appended text file that counts its flushes (each one a write to the OS)."""

    flushes = 0

    def flush(self):
        self.flushes += 1
        super().flush()


def bare_run(tmp_path, opened: list):
    """What the logging plugin reads of a run, its files opened as ``CountedFlushes`` into ``opened``."""
    def append(name):
        opened.append(CountedFlushes(open(tmp_path / name, "ab"), encoding="utf-8", newline=""))
        return opened[-1]

    return SimpleNamespace(rank=0, run_id="r1", stage="main", global_step=7, mode="fit", output_dir=tmp_path,
                           device_type="CPU", stages=[("main", None)], distribution={},
                           files=SimpleNamespace(append=append))


def test_a_logs_events_reach_the_os_in_one_flush_at_its_end_and_any_other_event_at_once(tmp_path):
    opened: list = []
    run, plugin = bare_run(tmp_path, opened), LoggingPlugin(stream=io.StringIO())
    plugin.on_fit_start(run)
    file, on_disk = opened[0], lambda: [e["event"] for e in events(tmp_path)]
    assert on_disk() == ["fit_start"]
    flushed = file.flushes
    plugin.on_log_metrics(run, {"train/loss": 0.5, "lr": 0.1}, 7)
    run.log.info("train", progress="7/10", loss=0.5)  # the progress plugin's line, inside the log
    run.log.warning("slow", seconds=2.0)  # any plugin's event inside the log
    plugin.end_log()
    assert file.flushes == flushed + 1 and on_disk() == ["fit_start", "metrics", "train", "slow"]
    run.log.info("outside")  # after the log: written and flushed at once
    assert file.flushes == flushed + 2 and on_disk()[-1] == "outside"
    plugin._close()


class FailsInTheLog:
    """Raises in ``on_log_metrics`` after the built-ins' (``trylast``, registered after them), before the
    logging plugin's ``end_log``."""

    name = "fails_in_the_log"

    @csf.hookimpl(trylast=True)
    def on_log_metrics(self, step):
        if step == 2:
            raise RuntimeError("broken plugin")


def test_a_log_that_a_plugin_breaks_still_leaves_its_events_in_the_file(tmp_path):
    with pytest.raises(csf.PluginError, match="broken plugin"):
        csf.Run(fixtures.compose("loop.max_steps=4", "loop.log_every=2"), plugins=[FailsInTheLog()],
                output_dir=tmp_path).fit()
    found = [(e["event"], e["step"]) for e in events(tmp_path)]
    assert found[-3:] == [("metrics", 2), ("train", 2), ("fit_failed", 2)]


def test_the_plugins_own_console_line_is_what_a_logging_handler_with_its_format_writes(monkeypatch):
    """Without a configured handler the plugin formats the line itself, on a record of what ``FORMAT`` shows:
    the same text as ``logging``'s record through a ``StreamHandler`` of that format, at every level; a
    stream that refuses it is reported as ``logging`` reports it, and the run goes on."""
    ours = io.StringIO()
    show = LoggingPlugin(stream=ours)._console()  # one writer through the clock's moves (its time text is
    # converted once a second: the next second's lines must not keep the last one's)
    for now, level in ((1_700_000_000.0421, "debug"), (1_700_000_000.9999, "info"), (1_700_000_001.0, "warning"),
                       (1_700_003_600.5, "error"), (1_700_003_600.5, "critical")):
        monkeypatch.setattr(time, "time", lambda: now)  # (LogRecord's clock on Python 3.11, ...)
        monkeypatch.setattr(time, "time_ns", lambda: int(now * 1e9))  # (... and on 3.13)
        ours.seek(0)
        ours.truncate()
        theirs = io.StringIO()
        show(level, "train   loss=0.5", now)
        handler = logging.StreamHandler(theirs)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.handle(logging.getLogger(LOGGER).makeRecord(LOGGER, getattr(logging, level.upper()), __name__, 0,
                                                              "train   loss=0.5", (), None))
        assert ours.getvalue() == theirs.getvalue() and "][csframework][" in ours.getvalue()
    assert ",500][csframework][CRITICAL] - train" in ours.getvalue()
    closed = io.StringIO()
    show = LoggingPlugin(stream=closed)._console()
    closed.close()
    show("info", "train", time.time())  # ValueError: I/O operation on closed file: reported on stderr, not raised


def test_an_event_json_cannot_hold_is_named_as_the_event_schema_says(tmp_path):
    run, plugin = bare_run(tmp_path, []), LoggingPlugin(stream=io.StringIO())
    plugin.on_fit_start(run)
    with pytest.raises(TypeError, match=r"^event 'x': value\.obj: a object cannot be written as JSON"):
        run.log.info("x", obj=object())
    plugin._close()
