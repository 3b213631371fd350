"""A worker process's watchdog: in a worker of a multirun (joblib/loky, submitit, Ray), a thread ends the
process when the multirun's parent is gone (killed outright, SIGKILL included): a running job gets a
SIGTERM (its step, a checkpoint, ``interrupted``) and ``WATCHDOG_GRACE_S`` seconds; an idle worker exits at
once."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

from ..signals import exit_status

PARENT_ENV = "CSFRAMEWORK_SWEEP_PARENT"  # the pid of the multirun's parent, inherited by worker processes
#: How often a worker's watchdog looks for the multirun's parent, and how long a running job then has to
#: save its checkpoint before the worker exits anyway.
WATCHDOG_POLL_S = 0.5
WATCHDOG_GRACE_S = 10.0

job_running = threading.Event()  # set while this process runs a job
_watchdog: list[threading.Thread] = []


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (from /proc: tells a reused pid apart), None when it is gone or a
    zombie; ``"?"`` where there is no /proc and the process exists."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "?"


def _watch(parent: int, started: str) -> None:
    while start_time(parent) == started:
        time.sleep(WATCHDOG_POLL_S)
    if job_running.is_set():  # a job runs: let it save its checkpoint, as on a SIGTERM of the multirun
        with contextlib.suppress(OSError):
            os.write(2, f"csframework: the multirun's process {parent} is gone: stopping this worker's job "
                        f"(exit within {WATCHDOG_GRACE_S:g} s)\n".encode())
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + WATCHDOG_GRACE_S
        while job_running.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(exit_status(signal.SIGTERM))


def start_watchdog() -> None:
    """In a worker process of a multirun (``PARENT_ENV`` names another process): once, a daemon thread
    that ends this process when the multirun's parent is gone."""
    parent = os.environ.get(PARENT_ENV, "")
    if _watchdog or not parent.isdigit() or int(parent) == os.getpid():
        return
    started = start_time(int(parent))
    if started is None:  # gone already
        os._exit(exit_status(signal.SIGTERM))
    thread = threading.Thread(target=_watch, args=(int(parent), started), name="csframework-sweep-watchdog",
                              daemon=True)
    thread.start()
    _watchdog.append(thread)
