"""A single run's directory, before Hydra creates it: checked, and what Hydra then creates for it remembered,
so that the CLI removes it again when nothing was written there (``mode=check``, a refused run, a torchrun
rank other than 0, which writes into rank 0's directory). Hydra writes the job's ``.hydra/`` files before
csframework can refuse the run: a refused run (exit 2) puts back an existing directory's ``.hydra/`` as it was,
and removes what it left in a directory it created (``undo_refused``). ``conf/config.yaml`` lists
``RunDirCallback``."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .. import hydra_session
from ..errors import CsfError, UnsafePathError
from ..files import SafeDir
from ..rundir import LOCK_NAME, check_run_dir

#: The directories Hydra is about to create for this process's single run, deepest first.
CREATED: list[Path] = []
#: What a refused run leaves in a directory it created: Hydra's record, the lock, the refusal's events
SETUP_ENTRIES = frozenset({".hydra", LOCK_NAME, "events.jsonl"})
#: The largest ``.hydra/`` file kept to be put back (Hydra's are a few kB)
MAX_HYDRA_FILE = 1 << 20


class HydraRecord(NamedTuple):
    """An existing run directory's ``.hydra/`` before this process's job rewrote it (``hydra_files``; ``None``:
    there was none), and what the run's records looked like then (``written``)."""
    run_dir: Path
    files: dict[str, bytes | None] | None
    written: tuple


def written(run_dir: Path) -> tuple:
    """When the run's metrics rows and checkpoints last changed (a step logged, a checkpoint saved): unchanged
    since ``on_run_start``, the job trained nothing there."""
    marks: list[tuple[int, int] | None] = []
    for name in ("metrics.csv", "checkpoints"):
        try:
            st = os.stat(run_dir / name, follow_symlinks=False)
            marks.append((st.st_mtime_ns, st.st_size))
        except OSError:
            marks.append(None)
    return tuple(marks)


BEFORE: list[HydraRecord] = []


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
        try:  # (a .hydra/ that cannot be read is not put back)
            BEFORE[:] = [] if CREATED else [HydraRecord(run_dir, hydra_files(SafeDir(run_dir)), written(run_dir))]
        except (OSError, UnsafePathError):
            BEFORE[:] = []


def hydra_files(run_dir: SafeDir) -> dict[str, bytes | None] | None:
    """The entries of ``run_dir``'s ``.hydra/``: a regular file's bytes, ``None`` for another entry (a link, an
    oversized file: left as it is then), or ``None`` when it has no ``.hydra/`` directory."""
    if run_dir.kind(".hydra") != "dir":
        return None
    hydra = run_dir.sub(".hydra", create=False)
    kept: dict[str, bytes | None] = {}
    for name in hydra.names():
        try:
            kept[name] = hydra.read(name, MAX_HYDRA_FILE)
        except (OSError, ValueError, UnsafePathError):
            kept[name] = None
    return kept


def undo_refused() -> None:
    """After a refused run (exit 2), when it trained nothing: a directory this process created holds only what the
    refusal left (``SETUP_ENTRIES``), removed with it; an existing one gets its ``.hydra/`` back as it was, so
    that it still records the run that wrote it. Best effort: a failure here leaves what is there."""
    try:
        if CREATED:
            created = SafeDir(CREATED[0])
            if set(created.names()) <= SETUP_ENTRIES:
                for name in created.names():
                    created.remove(name)
        for record in BEFORE:
            if written(record.run_dir) != record.written:  # it trained before it was refused: its record stays
                continue
            run_dir = SafeDir(record.run_dir)
            if record.files is None:
                if run_dir.kind(".hydra") == "dir":
                    run_dir.remove(".hydra")
                continue
            hydra = run_dir.sub(".hydra")
            for name in set(hydra.names()) - set(record.files):
                hydra.remove(name)
            for name, data in record.files.items():
                if data is not None:
                    hydra.write(name, data)
    except (OSError, UnsafePathError):
        pass


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
