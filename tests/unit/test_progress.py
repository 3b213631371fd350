"""``csframework.builtin.progress``, the progress plugin: a bar redrawn in place on a terminal, log lines otherwise."""
import io

import csframework as csf
import fixtures
from csframework.builtin.progress import ProgressPlugin


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run_with_progress(tmp_path, stream):
    cfg = fixtures.compose("loop.max_steps=6", "loop.log_every=3", "plugins.disable=[progress]")
    plugin = ProgressPlugin(stream=stream, min_interval=0.0)
    plugin.name = "progress_under_test"  # the built-in one is disabled by name
    return csf.Run(cfg, plugins=[plugin], output_dir=tmp_path).fit()


def test_bar_on_a_terminal_shows_steps_loss_and_rate(tmp_path):
    term = Terminal()
    run_with_progress(tmp_path, term)
    text = term.getvalue()
    frames = [f for f in text.split("\r") if f.strip()]
    assert len(frames) >= 6, "the bar is redrawn every step when min_interval is 0"
    assert "6/6" in frames[-1] and "loss" in frames[-1] and "steps/s" in frames[-1]
    assert text.endswith("\n")


def test_no_bar_when_not_a_terminal(tmp_path):
    plain = io.StringIO()
    run_with_progress(tmp_path, plain)
    assert "\r" not in plain.getvalue()
