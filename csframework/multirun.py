"""What the CLI needs to know of a multirun without importing the sweep package (``csframework.sweep``: its
table, plot and launcher guards), which a single run never loads: the command line a sweeper needs, the end of
a launcher that cannot go on, and whether this process started a multirun."""
from __future__ import annotations

import sys


class SweepEnded(SystemExit):
    """The launcher cannot go on (a joblib worker process died): every job of its batch has its row; the
    multirun ends with ``finish`` (``ExitCode.FAILED``). A ``SystemExit``, so that Hydra does not report it as a
    crash with a traceback."""


def sweeper_overrides(argv: list[str]) -> list[str]:
    """The command line, with Optuna's direction following ``sweep.direction`` unless it is given."""
    if any(a.startswith("hydra/sweeper=optuna") for a in argv) and not any(
            a.startswith("hydra.sweeper.direction=") for a in argv):
        return [*argv, "hydra.sweeper.direction=${sweep.direction}"]
    return argv


def multirun_started() -> bool:
    """Whether this process started a multirun (``SweepCallback`` imported the sweep package and started it):
    the CLI then ends with ``csframework.sweep.finish``."""
    sweep = sys.modules.get("csframework.sweep")
    return sweep is not None and sweep.started()
