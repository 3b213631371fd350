"""``checkpoint.start_over=true``: the run a run directory holds is moved into ``previous-runs/<date>_<time>/``
there, all or nothing (``move_aside``).

Every entry is checked before any is moved, against what a rename needs: the run directory and
``previous-runs/`` writable and searchable, each directory entry writable (a directory moved to another parent
rewrites its ``..``), the same file system, no sticky bit in the way. The checks read the modes themselves,
so a directory made read-only counts as one for root too, whose privilege would otherwise move it. A rename
that fails all the same (an immutable file, a race) puts back what was already moved, so the old run is left
as it was, and one line (``RunDirHoldsRun``, exit 2) names the entry and the fix.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import stat
from pathlib import Path
from typing import Iterable, Sequence

from .errors import RunDirHoldsRun, printable
from .files import SafeDir

#: Where ``checkpoint.start_over=true`` moves an earlier run's files (one directory per earlier run)
PREVIOUS_RUNS = "previous-runs"


def move_aside(files: SafeDir, keep: Iterable[str] = ()) -> Path:
    """Move every entry of the run directory ``files`` but ``keep`` (its lock) and ``previous-runs/`` into a
    new ``previous-runs/<date>_<time>/`` there (renames: links moved, never followed); returns that directory.
    All or nothing: ``RunDirHoldsRun`` naming the entry that cannot be moved, the run directory left as it was."""
    kept = {PREVIOUS_RUNS, *keep}
    with files.opened(create=False) as src:
        entries = sorted(name for name in os.listdir(src) if name not in kept)
        problem = _unmovable(files, src, entries)
        if problem:
            raise _refusal(files, *problem)
    created = files.kind(PREVIOUS_RUNS) is None
    previous = files.sub(PREVIOUS_RUNS)
    with files.opened(create=False) as src, previous.opened(create=False) as holder:
        try:
            name = _new_dir(files, holder)
        except RunDirHoldsRun:
            _remove_made(src, holder, None, created)
            raise
        with SafeDir(previous.path, name).opened(create=False) as dst:
            moved: list[str] = []
            try:
                for entry in entries:
                    os.rename(entry, entry, src_dir_fd=src, dst_dir_fd=dst)
                    moved.append(entry)
            except OSError as e:
                stuck = _put_back(moved, src, dst)
                if not stuck:
                    _remove_made(src, holder, name, created)
                raise _refusal(files, entry, e.strerror or str(e),
                               f"make {files / entry} movable (its permissions, or lsattr for an immutable flag)",
                               stuck, previous.path / name) from None
            os.fsync(dst)
        os.fsync(src)
    return previous.path / name


def _remove_made(src: int, holder: int, name: str | None, created: bool) -> None:
    """Remove what a start over that moved nothing made: its ``previous-runs/<time>/`` and, if it made it,
    ``previous-runs/``, so that the run directory is as it was."""
    with contextlib.suppress(OSError):
        if name is not None:
            os.rmdir(name, dir_fd=holder)
        if created:
            os.rmdir(PREVIOUS_RUNS, dir_fd=src)


def _new_dir(files: SafeDir, holder: int) -> str:
    """A new directory in ``previous-runs/`` (``holder``) named by the date and time (``_2``, ``_3`` ... when
    that one exists); ``RunDirHoldsRun`` when ``previous-runs/`` cannot take it."""
    info = os.fstat(holder)
    if not _may_write(info) or info.st_dev != os.stat(files.path).st_dev:
        raise _refusal(files, PREVIOUS_RUNS, "it is read-only or on another file system",
                       f"chmod u+w {files / PREVIOUS_RUNS}, or remove it if it is a mount")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    name, n = stamp, 1
    while True:
        try:
            os.mkdir(name, 0o755, dir_fd=holder)
            return name
        except FileExistsError:
            n += 1
            name = f"{stamp}_{n}"
        except OSError as e:
            raise _refusal(files, PREVIOUS_RUNS, f"cannot create a directory in it: {e.strerror or e}",
                           f"make {files / PREVIOUS_RUNS} writable") from None


def _unmovable(files: SafeDir, src: int, entries: list[str]) -> tuple[str, str, str] | None:
    """``(entry, why, fix)`` for the first thing that would stop the renames, or None."""
    here = os.fstat(src)
    if not _may_write(here):
        return ".", "the run directory is read-only", f"chmod u+w {files.path}"
    for entry in entries:
        try:
            info = os.stat(entry, dir_fd=src, follow_symlinks=False)
        except FileNotFoundError:  # gone since the listing: nothing to move
            continue
        path = files / entry
        if info.st_dev != here.st_dev:
            return entry, "it is on another file system (a mount)", f"unmount or move {path} yourself"
        if here.st_mode & stat.S_ISVTX and os.geteuid() not in (0, here.st_uid, info.st_uid):
            return entry, "the run directory is sticky and the entry is another user's", f"move {path} yourself"
        if stat.S_ISDIR(info.st_mode) and not _may_write(info):
            return entry, f"it is a read-only directory (mode {stat.S_IMODE(info.st_mode):04o})", f"chmod u+w {path}"
    return None


def _may_write(info: os.stat_result) -> bool:
    """Whether a directory's mode bits let this process write in it: its owner's bits for its owner and for
    root (so that what is read-only for its owner is so for root as well), its group's for a member of the
    group, the others' for the rest."""
    uid = os.geteuid()
    if uid in (0, info.st_uid):
        return bool(info.st_mode & stat.S_IWUSR)
    if info.st_gid in (os.getegid(), *os.getgroups()):
        return bool(info.st_mode & stat.S_IWGRP)
    return bool(info.st_mode & stat.S_IWOTH)


def _put_back(moved: list[str], src: int, dst: int) -> list[str]:
    """Rename ``moved`` back from ``dst`` to ``src``, newest first; returns those that could not be."""
    stuck = []
    for entry in reversed(moved):
        try:
            os.rename(entry, entry, src_dir_fd=dst, dst_dir_fd=src)
        except OSError:
            stuck.append(entry)
    return stuck


def _refusal(files: SafeDir, entry: str, why: str, fix: str, stuck: Sequence[str] = (),
             holder: Path | None = None) -> RunDirHoldsRun:
    """The one line of a start over that moved nothing (or, ``stuck``, could not put everything back)."""
    where = "its files" if entry == "." else entry
    names = ", ".join(sorted(stuck)[:5]) + (f" and {len(stuck) - 5} more" if len(stuck) > 5 else "")
    state = (f"{len(stuck)} of its entries could not be put back and are in {holder} ({names})"
             if stuck else "nothing was moved: the run there is as it was")
    return RunDirHoldsRun(printable(
        f"checkpoint.start_over=true: cannot move {where} of run directory {files.path} into {PREVIOUS_RUNS}/ "
        f"({why}); {state}; {fix}, or start the new run in another directory (hydra.run.dir=...)"))
