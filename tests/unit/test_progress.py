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


def test_the_plugin_has_a_per_step_hook_only_while_it_draws_a_bar(tmp_path):
    """Without a terminal no step calls the progress plugin (nothing to redraw); on one, the bar's own
    plugin moves it at every step while it is drawn, and is gone once training ends."""
    steppers = []

    class Watch:
        name = "watch"

        @csf.hookimpl
        def on_train_batch_end(self, run):
            steppers.append(sorted(run.hooks.pm.get_name(impl.plugin) for impl in
                                   run.hooks.pm.hook.on_train_step_end.get_hookimpls()))

    # (the checkpoint plugin has no per-step hook: it saves through run.set_save_due's save)
    for stream, expected in ((io.StringIO(), []), (Terminal(), ["progress_under_test.bar"])):
        steppers.clear()
        cfg = fixtures.compose("loop.max_steps=3", "plugins.disable=[progress]")
        plugin = ProgressPlugin(stream=stream, min_interval=0.0)
        plugin.name = "progress_under_test"
        run = csf.Run(cfg, plugins=[plugin, Watch()], output_dir=tmp_path / type(stream).__name__)
        run.fit()
        assert steppers == [expected] * 3
        assert "progress_under_test.bar" not in dict(run.hooks.pm.list_name_plugin())
