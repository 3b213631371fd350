"""One writer per run directory, and one run: a fresh run never starts over a run directory that holds
a run (``check_fresh_start``, which every way into a run passes through: ``Run.fit`` and ``Run.validate``
from Python, the CLI, a sweep's jobs), nor does a checkpoint of another run resume there, unless asked with
``checkpoint.start_over=true`` (the old run's files are moved aside first: ``previous_runs.move_aside``).

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

from .errors import RunDirHoldsRun, RunDirInUse, UnsafePathError, printable
from .files import SafeDir
from .previous_runs import PREVIOUS_RUNS, move_aside

LOCK_NAME = ".csframework.lock"
#: What says that a run directory holds a run: what the next run would append to, overwrite or prune
RUN_RECORDS = ("checkpoints", "summary.json", "metrics.csv", "events.jsonl")
_SUMMARY_BYTES = 1 << 20  # what an earlier run's summary.json may take for its run id to be read
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


def check_fresh_start(run) -> None:
    """The fresh-run rule, checked once per ``Run`` when its first ``fit`` or ``validate`` starts (rank 0, the
    run directory's lock held, before anything is written): in a directory that holds a run
    (``run_records``), only ``checkpoint.resume=auto`` or a checkpoint of that run (``other_lineage``) goes on.
    Anything else, a fresh run or a checkpoint of another run, is refused (``RunDirHoldsRun``, exit 2, naming
    the directory and the ways on), or with ``checkpoint.start_over=true`` the old run's files are moved into
    ``previous-runs/<time>/`` first, all or nothing."""
    from .command import continue_run

    files, resume = run.files, str(run.config.checkpoint.resume)
    if resume == "auto":
        return
    found = run_records(files)
    if not found:
        return
    other = None if resume == "never" else other_lineage(Path(resume), files)
    if resume != "never" and other is None:  # a checkpoint of the run there: it goes on
        return
    if run.config.checkpoint.start_over:
        moved = move_aside(files, keep=(LOCK_NAME,))
        run.log.warning("previous_run_moved", path=str(moved),
                        problem=f"{files.path} held a run; its files are now in {moved} (checkpoint.start_over=true)")
        return
    shown, ways = printable(str(files.path)), (
        f"or here with checkpoint.start_over=true (the old run's files are moved into {PREVIOUS_RUNS}/ there)")
    if other is not None:
        raise RunDirHoldsRun(printable(
            f"checkpoint.resume={resume}: {other}, not of the run that run directory {shown} holds "
            f"({', '.join(found)}); resume it into a new run directory (hydra.run.dir=...), {ways}; or continue "
            f"the run there with: {continue_run(files.path)}"))
    raise RunDirHoldsRun(
        f"run directory {shown} holds a run ({', '.join(found)}); continue it with: "
        f"{printable(continue_run(files.path))}, or start a new run in another directory (hydra.run.dir=...), "
        + ways)


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


def other_lineage(target: Path, files: SafeDir) -> str | None:
    """Why the checkpoints ``checkpoint.resume=<target>`` may load are not of the run that the run directory
    ``files`` holds (one phrase), or None when they are: each is one of that directory's own checkpoints (in
    its ``checkpoints/``, as ``resume=auto`` would choose), or its run id (its meta.json) is one that
    directory's own records carry (the meta.json of its checkpoints, its summary.json): a copy of one of
    them elsewhere. Lying below the run directory decides nothing: a checkpoint under ``previous-runs/``
    there is an earlier run's."""
    from .builtin.checkpoint.store import checkpoint_names, resume_source, scan_checkpoints

    source, choose = resume_source(target)
    own = files / "checkpoints"
    candidates = [source / name for name in checkpoint_names(source)[0]] if choose else [source]
    if not candidates and os.path.realpath(source) != os.path.realpath(own):
        return f"{source} holds no complete checkpoint"
    elsewhere = [c for c in candidates if os.path.realpath(c.parent) != os.path.realpath(own)]
    if not elsewhere:  # its own (a damaged one is named by the resume itself)
        return None
    ours = {_run_id_of(own / name) for name in scan_checkpoints(own)} | {_summary_run_id(files)}
    for checkpoint in elsewhere:
        run_id = _run_id_of(checkpoint)
        if run_id is None:
            return f"checkpoint {checkpoint} records no run id (an older or damaged checkpoint)"
        if run_id not in ours:
            return f"checkpoint {checkpoint} is of run {run_id}"
    return None


def _run_id_of(checkpoint: Path) -> str | None:
    """The run id a checkpoint's meta.json records (read as untrusted data), or None."""
    from .builtin.checkpoint.format import read_meta
    from .errors import DamagedCheckpoint

    try:
        run_id = read_meta(checkpoint).get("run_id")
    except DamagedCheckpoint:
        return None
    return run_id[:64] if isinstance(run_id, str) and run_id else None


def _summary_run_id(files: SafeDir) -> str | None:
    """The run id of the run directory's summary.json (read as untrusted data), or None."""
    try:
        run_id = json.loads(files.read("summary.json", _SUMMARY_BYTES)).get("run_id")
    except (OSError, ValueError, AttributeError, RecursionError, UnsafePathError):
        return None
    return run_id[:64] if isinstance(run_id, str) and run_id else None


def default_output_dir() -> Path:
    """Hydra's output directory when Hydra runs the job, else ``outputs/<date>/<time>`` like Hydra's."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    now = datetime.datetime.now()
    return Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S-%f")
