"""Loader workers that hang on purpose, and the checks that none survives its run: shared by the in-process
tests (tests/unit/test_data.py) and the CLI ones (tests/e2e/test_loader_hangs.py). ``Stalling`` workers write
their pid into a directory, so each test checks the very processes of its run."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from torch.utils.data import get_worker_info

from fixtures import Blobs


TIMEOUT_S = 2
#: generous bound for "fails within data.timeout_s + a few seconds" on a loaded machine; the default
#: timeout (600 s) or none at all would exceed it
BOUND_S = TIMEOUT_S + 25


class Stalling(Blobs):
    """Blobs whose loader workers record their pid as a file in ``pid_dir``; worker ``hang_worker`` sleeps
    forever on its ``after + 1``-th sample, after writing ``hung-<pid>`` and, once every worker has recorded
    its pid, sending the main process the signals ``signal_parent`` lists (e.g. ``KILL``, ``TERM-TERM``; one second apart, so none merge into
    the one before); ``delay`` slows every sample."""

    def __init__(self, pid_dir: str, hang_worker: int = -1, after: int = 0, delay: float = 0.0,
                 signal_parent: str = "", **kwargs):
        super().__init__(**kwargs)
        self.pid_dir, self.hang_worker, self.after, self.delay = Path(pid_dir), hang_worker, after, delay
        self.signal_parent = [getattr(signal, f"SIG{name}") for name in signal_parent.split("-") if name]
        self.served = 0  # per worker process (each has its own copy)

    def __getitem__(self, i):
        info = get_worker_info()
        if info is not None:
            if self.served == 0:
                self.pid_dir.mkdir(parents=True, exist_ok=True)
                (self.pid_dir / str(os.getpid())).touch()
            self.served += 1
            if info.id == self.hang_worker and self.served > self.after:
                (self.pid_dir / f"hung-{os.getpid()}").touch()
                deadline = time.monotonic() + 60
                while len(worker_pids(self.pid_dir)) < info.num_workers and time.monotonic() < deadline:
                    time.sleep(0.05)  # every worker is recorded before the main process is signalled
                for signum in self.signal_parent:
                    os.kill(os.getppid(), signum)
                    time.sleep(1)
                time.sleep(10**6)
        if self.delay:
            time.sleep(self.delay)
        return super().__getitem__(i)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def worker_pids(pid_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in pid_dir.iterdir() if p.name.isdigit()) if pid_dir.is_dir() else []


def hung_pid(pid_dir: Path) -> int:
    (found,) = [int(p.name.split("-")[1]) for p in pid_dir.glob("hung-*")]
    return found


def survivors(pid_dir: Path, within: float = 0.0) -> list[int]:
    """The recorded workers still running after waiting up to ``within`` seconds for them to go."""
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid in worker_pids(pid_dir) if alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def stalling(pid_dir: Path, key: str = "train", **options) -> list[str]:
    """Overrides making ``data.<key>`` a ``Stalling`` set recording into ``pid_dir``."""
    return [f"data.{key}._target_=stalling.Stalling", f"+data.{key}.pid_dir={pid_dir}",
            *(f"++data.{key}.{name}={value}" for name, value in options.items())]
