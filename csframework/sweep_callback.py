"""The Hydra callbacks of a multirun's start that ``conf/config.yaml`` registers (``hydra.callbacks.sweep_check``
and ``.sweep``). Hydra instantiates them for every command, a single run's too, so they are kept apart from the sweep package (``csframework.sweep``: the
table, the plot, the launcher guards), which they import only when a multirun starts (start-up, issue 50)."""
from __future__ import annotations

from hydra.experimental.callback import Callback


class SweepCallback(Callback):
    """The multirun's parent: a fresh start (no mark of an earlier run's interruption or refused jobs) in a
    sweep directory checked first; what is wrong there is one line and exit 2, before any job starts
    (``csframework.sweep.start``)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        from .sweep import start

        start(config)


class SweepCheck(Callback):
    """Before any job (listed before ``SweepCallback``): every value of every swept key composed and typed as the
    jobs will be, then SIGINT and SIGTERM forwarded to the jobs until the multirun ends
    (``csframework.sweep.check.start_checked``)."""

    def on_multirun_start(self, config, config_name: str | None = None, **kwargs) -> None:
        from .sweep.check import start_checked

        start_checked(config, config_name)
