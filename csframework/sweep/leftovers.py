"""The multirun's own processes end with it (docs/sweeps.md, "Stopping a sweep"; issue 47 item 15).

A parallel launcher leaves helpers behind its jobs: loky's workers, loky's and ``multiprocessing``'s resource
trackers (which block SIGINT and SIGTERM, and end only when every process holding their pipe has closed it),
and whatever a job forked (data loader workers). Once every job has ended, the parent closes its end of the
trackers' pipes, waits a moment for the sweep's processes to go, and kills those that outlive it.

A process is the sweep's when its environment names this multirun's parent (``job.PARENT_ENV``, set before
any job starts and inherited by every process started under it, also after its parent died and it was
adopted); a process that merely has the same parent is not looked for (a test runner's other children).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from .job import PARENT_ENV

#: How long the sweep's processes may take to end after its last job, before they are killed (a resource
#: tracker removes what its workers leaked; under load that takes a moment).
GRACE_SECONDS = 5.0
#: The modules whose resource tracker this process may hold a pipe to.
_TRACKERS = ("joblib.externals.loky.backend.resource_tracker", "multiprocessing.resource_tracker")


def sweep_processes(parent: int) -> list[int]:
    """The live processes (zombies are not) started under the multirun whose parent is ``parent``, itself
    excluded; none where there is no ``/proc``."""
    marker = f"{PARENT_ENV}={parent}".encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in entries:
        if not name.isdigit() or int(name) == parent:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read(1 << 20).split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if marker in environ and _alive(int(name)):
            found.append(int(name))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended; this process's own child is reaped here)."""
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def close_resource_trackers() -> None:
    """Close this process's end of its resource trackers' pipes (loky's, ``multiprocessing``'s): a tracker
    ends once no process holds the pipe, and the parent lives on for the sweep's last lines. One needed again
    before the parent exits is started afresh and ends with it."""
    for module in _TRACKERS:
        tracker = getattr(sys.modules.get(module), "_resource_tracker", None)
        fd = getattr(tracker, "_fd", None)
        if isinstance(fd, int):
            with contextlib.suppress(OSError):
                os.close(fd)
            tracker._fd = tracker._pid = None


def end_sweep_processes(parent: int, grace: float = GRACE_SECONDS) -> list[str]:
    """After the multirun's last job: close the trackers' pipes, wait up to ``grace`` seconds for the sweep's
    processes to end, and kill (SIGKILL: the trackers block SIGTERM) those still running. Returns what was
    killed, ``<pid> (<command>)`` each."""
    close_resource_trackers()
    deadline = time.monotonic() + grace
    left = sweep_processes(parent)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = sweep_processes(parent)
    killed = []
    for pid in left:
        name = _command(pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(f"{pid} ({name})")
    for pid in left:  # reap this process's own children
        _alive(pid)
    return killed


def _command(pid: int) -> str:
    """The first words of ``pid``'s command line, for the line that says it was killed."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(4096).split(b"\0")
    except OSError:
        return "?"
    return " ".join(w.decode(errors="replace") for w in words[:3] if w)[:80]
