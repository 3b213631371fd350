"""A single run's directory, before Hydra creates it: checked, and what Hydra then creates for it remembered,
so that the CLI removes it again when nothing was written there (``mode=check``, a refused run, a torchrun
rank other than 0, which writes into rank 0's directory). ``conf/config.yaml`` lists ``RunDirCallback``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .. import hydra_session
from ..errors import CsfError
from ..rundir import check_run_dir

#: The directories Hydra is about to create for this process's single run, deepest first.
CREATED: list[Path] = []


class RunDirCallback(Callback):
    """``on_run_start`` (before Hydra's job creates the run directory): ``hydra.run.dir`` resolved (its
    interpolation errors a ``ConfigError`` naming it) and checked (``check_run_dir``); an error is carried
    to the CLI's one-line report past Hydra's callback guard (``hydra_session.CallbackError``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            run_dir = Path(hydra_session.resolve_run_dir(config)).absolute()
            check_run_dir(run_dir)
        except CsfError as e:
            raise hydra_session.CallbackError(e) from e
        CREATED[:] = new_directories(run_dir)


def new_directories(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_if_empty(directories: list[Path]) -> None:
    """Remove the directories this process created for a run that then wrote nothing there (a rejected
    run, ``mode=check``, a rank other than 0); ``rmdir`` refuses any directory that holds something."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return
