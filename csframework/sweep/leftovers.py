"""The multirun's own processes end with it (docs/guides/sweeps.md, "Stopping a sweep"; issue 47 item 15).

A parallel launcher leaves helpers behind its jobs: loky's workers, loky's and ``multiprocessing``'s resource
trackers (which block SIGINT and SIGTERM, and end only when every process holding their pipe has closed it),
and whatever a job started (data loader workers; a process whose parent died is adopted by init, out of reach
of loky, which ends each worker's tree of processes). Once every job has ended, the parent waits a moment for
the sweep's processes to go and kills those that outlive it; its own trackers end when it exits.

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


def own_trackers() -> set[int]:
    """The pids of this process's resource trackers (loky's, ``multiprocessing``'s): each ends, after removing
    what the sweep leaked, when this process exits and so closes its pipe (once no other process of the
    sweep's holds it: ``end_sweep_processes`` sees to that). Ending one earlier would leave that undone."""
    pids = set()
    for module in _TRACKERS:
        pid = getattr(getattr(sys.modules.get(module), "_resource_tracker", None), "_pid", None)
        if isinstance(pid, int):
            pids.add(pid)
    return pids


def end_sweep_processes(parent: int, grace: float = GRACE_SECONDS) -> list[str]:
    """After the multirun's last job: wait up to ``grace`` seconds for the sweep's processes (but this
    process's own resource trackers, ``own_trackers``) to end, and kill (SIGKILL: a tracker, or a job's helper,
    may block SIGTERM) those still running. Returns what was killed, ``<pid> (<command>)`` each."""
    deadline = time.monotonic() + grace
    mine = own_trackers()
    left = [pid for pid in sweep_processes(parent) if pid not in mine]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in sweep_processes(parent) if pid not in mine]
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
