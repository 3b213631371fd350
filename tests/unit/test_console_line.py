"""The logging plugin writes console lines itself (``console_line``) instead of through structlog's
``ConsoleRenderer``, which costs more than the rest of a log step: the text must stay the renderer's."""
import pytest
import structlog

from csframework.builtin.logs import console_line


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
