"""One writer per run directory, and what says that it holds a run (``run_records``; the rule that a
fresh run never starts over one is ``fresh_run.check_fresh_start``).

A run that writes (``Run.fit``, ``Run.validate``; rank 0 only) holds an exclusive ``flock`` on
``<run dir>/.csframework.lock`` for as long as it runs. The lock belongs to the open file, so the operating
system releases it whenever the process ends, however it ends (an exception, ``os._exit``, SIGKILL):
there is never a stale lock to clean up. The file itself stays; it only says who holds the lock (JSON
``{pid, host, started}``), so that a second run on the same directory can name the first and exit 2
instead of interleaving its checkpoints, index and logs with the first's.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import stat
from pathlib import Path

from .errors import RunDirInUse, UnsafePathError, printable
from .files import SafeDir

LOCK_NAME = ".csframework.lock"
#: What says that a run directory holds a run: what the next run would append to, overwrite or prune
RUN_RECORDS = ("checkpoints", "summary.json", "metrics.csv", "events.jsonl")
_HOLDER_BYTES = 4096  # what the holder record may take; more is not ours and is not read


_held: set[int] = set()  # lock descriptors this process holds


def _close_in_child() -> None:
    """A forked child (a data-loader worker) must not keep the lock alive: flock belongs to the open file,
    which fork shares, so a worker outliving a SIGKILLed run would hold it (O_CLOEXEC covers exec only).
    Closing the child's copy leaves the parent's lock in place."""
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)




def _holder(fd: int) -> str:
    """Who holds the lock, from the record the holder wrote (it may not have written it yet)."""
    try:
        record = json.loads(os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8"))
        return printable(f"pid {int(record['pid'])} on host {str(record['host'])[:255]}, "
                         f"started {str(record['started'])[:64]}")
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return "a process that has not written its pid, host and start time yet"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path):
    """Hold the run directory's lock while the block runs; raise ``RunDirInUse`` if another process (or
    another run in this process) holds it. Creates the directory and its lock file if needed; a lock file
    that is a link, a FIFO, a directory or has another name (a hard link) is refused (``UnsafePathError``):
    it is never followed, blocked on or truncated."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_NAME
    fd = SafeDir(run_dir).lock_file(LOCK_NAME)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirInUse(f"run directory {run_dir} is in use by another csframework run ({_holder(fd)}; "
                              f"lock file {path}); wait for it to finish, or give this run another directory "
                              "(hydra.run.dir=...)") from None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        _held.add(fd)
        yield path
    finally:
        _held.discard(fd)
        os.close(fd)  # releases the lock; the file stays (removing it would race with a process opening it)


def writer_lock(run_dir: Path, rank: int) -> contextlib.AbstractContextManager:
    """What a run holds while it runs (``Run.fit``/``validate``): on rank 0 the run directory's lock
    (``run_dir_lock``), taken before any hook writes there, so a run refused for it never reaches
    ``on_exception`` and the holder's ``summary.json`` is left alone; on the other ranks nothing."""
    return run_dir_lock(run_dir) if rank == 0 else contextlib.nullcontext()


def check_run_dir(run_dir: Path | None) -> None:
    """Refuse (``UnsafePathError``, exit 2) a run directory that exists but is not a real directory: a
    file, or a link (which may lead into another run's directory), before anything is written."""
    if run_dir is None:
        return
    try:
        mode = os.lstat(run_dir).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError:  # a file where one of its parents belongs
        raise UnsafePathError(f"run directory {run_dir}: a file lies where one of its parent directories belongs; "
                              "give another directory (hydra.run.dir=...)") from None
    if stat.S_ISLNK(mode):
        raise UnsafePathError(f"run directory {run_dir}: it is a symbolic link (to {os.readlink(run_dir)}); give "
                              "the directory itself (hydra.run.dir=...) or remove the link")
    if not stat.S_ISDIR(mode):
        raise UnsafePathError(f"run directory {run_dir}: it exists and is not a directory; remove it or give "
                              "another directory (hydra.run.dir=...)")


def run_records(files: SafeDir) -> list[str]:
    """The entries of ``RUN_RECORDS`` that the run directory ``files`` holds as a run writes them: a regular
    file, a real ``checkpoints/`` directory with something in it. A link, a FIFO or a directory in a file's
    place is no run's: the safe file layer refuses it, naming it, when the run would write there."""
    found = []
    for name in RUN_RECORDS:
        kind = files.kind(name)
        if name == "checkpoints":
            if kind == "dir" and files.sub(name, create=False).names():
                found.append(name)
        elif kind == "file":
            found.append(name)
    return found


def default_output_dir() -> Path:
    """Hydra's output directory when Hydra runs the job, else ``outputs/<date>/<time>`` like Hydra's."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    now = datetime.datetime.now()
    return Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S-%f")
