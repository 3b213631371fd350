"""The marks a multirun leaves in its sweep directory for its jobs, in whatever process they run: the stop
(``.interrupted``: later jobs do not start), the refused jobs (``.refused``: the multirun exits 1) and the
console warnings already shown (``.said``: each once per sweep). All read as untrusted, through
``files.SafeDir``."""
from __future__ import annotations

import contextlib
import signal
from pathlib import Path

from ..errors import CsfError, UnsafePathError
from ..files import SafeDir
from .table import locked

INTERRUPTED = ".interrupted"
REFUSED = ".refused"  # jobs of this multirun not run because their run directory belongs to another sweep
SAID = ".said"  # the warnings a job of this multirun has shown on the console, one key a line

_stopped: list[int] = []  # the stop signal this process saw during this multirun (if .interrupted is lost)
_MAX_SAID_BYTES = 1 << 16


def reset_stop() -> None:
    """A new multirun in this process: no stop seen yet."""
    _stopped.clear()


def interrupted_by(sweep_dir: Path) -> int | None:
    """The signal that interrupted the sweep in ``sweep_dir`` (this multirun), else ``None``."""
    if _stopped:
        return _stopped[0]
    sweep = SafeDir(sweep_dir)
    try:
        if sweep.kind(INTERRUPTED) is None:
            return None
        text = sweep.read(INTERRUPTED, 16).decode("ascii", "replace").strip()
    except (OSError, ValueError, UnsafePathError):
        return signal.SIGINT  # something is there and cannot be read: stopping is the safe reading
    return int(text) if text.isdigit() and 0 < int(text) < 65 else signal.SIGINT


def mark_interrupted(sweep_dir: Path, signum: int) -> None:
    """Record the stop (in this process, and in ``.interrupted`` for the other processes of the sweep).
    Called from signal handlers: never raises."""
    if not _stopped:
        _stopped.append(int(signum))
    sweep = SafeDir(sweep_dir)
    with contextlib.suppress(OSError, CsfError):
        if sweep.kind(INTERRUPTED) is None:
            sweep.write(INTERRUPTED, str(int(signum)), durable=False)


def refuse(sweep_dir: Path, num: int) -> None:
    """Record that job ``num`` was refused (the multirun then exits 1)."""
    with contextlib.suppress(OSError, CsfError), SafeDir(sweep_dir).append(REFUSED) as f:
        f.write(f"{num}\n")


def refused_jobs(sweep_dir: Path) -> set[int]:
    """The jobs ``refuse`` recorded in this multirun (read as untrusted: what is not a job number is left out)."""
    try:
        text = SafeDir(sweep_dir).read(REFUSED, 1 << 20).decode("ascii", "replace")
    except (OSError, ValueError, CsfError):
        return set()
    return {int(line) for line in text.split() if line.isdigit()}


def first_in_sweep(sweep_dir: Path, key: str) -> bool:
    """Whether this job is the first of the multirun in ``sweep_dir`` to show the warning ``key`` on the
    console (``console_once``: a job asks it for the built-ins while it runs): a warning every job would
    repeat (a default too long for a short run, say) is shown once per sweep, and recorded in every job's
    ``events.jsonl``. Kept in the sweep directory's ``.said``, under the table's lock, so jobs in other
    processes (joblib, submitit, Ray) see it too. True whenever the record cannot be read or written (a
    warning shown twice beats one lost)."""
    try:
        with locked(sweep_dir):
            sweep = SafeDir(sweep_dir)
            said = sweep.read(SAID, _MAX_SAID_BYTES).decode("utf-8", "replace").splitlines() \
                if sweep.kind(SAID) is not None else []
            if key in said:
                return False
            with sweep.append(SAID) as f:
                f.write(key + "\n")
        return True
    except (OSError, ValueError, CsfError):
        return True
