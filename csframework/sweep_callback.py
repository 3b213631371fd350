"""The Hydra callback ``conf/config.yaml`` registers (``hydra.callbacks.sweep``). Hydra instantiates it for
every command, a single run's too, so it is kept apart from the sweep package (``csframework.sweep``: the
table, the plot, the launcher guards), which it imports only when a multirun starts (start-up, issue 50)."""
from __future__ import annotations

from hydra.experimental.callback import Callback


class SweepCallback(Callback):
    """The multirun's parent: a fresh start (no mark of an earlier run's interruption or refused jobs) in a
    sweep directory checked first; what is wrong there is one line and exit 2, before any job starts
    (``csframework.sweep.start``)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        from .sweep import start

        start(config)
