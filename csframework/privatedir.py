"""Directories trusted as OpenSSH's ``StrictModes`` trusts ``~/.ssh``: the file layer (``files.SafeDir``) for
what csframework would *execute* from a directory (compile caches: pickled artifacts, generated modules).

A directory is trusted only when every directory from its root down, and every file in it, is owned by this
user and writable by no one else (mode & 0o022 clear: a file unpacked from an archive or written under a loose
umask as 0666 is someone else's to rewrite), and every file is regular and single-linked. The tree walk holds a
bounded number of descriptors however wide the tree is (docs/durability.md, "Compile caches").
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import UnsafePathError
from .files import _DIR, SafeDir, _why

#: How many directories below its root a trusted tree may reach. Inductor's cache is about six deep; the walk
#: re-opens each directory from the root (so it holds at most three descriptors), and this bounds what that
#: costs on a planted deep tree, which is refused.
MAX_DEPTH = 32


class UntrustedDirError(UnsafePathError):
    """A ``PrivateDir`` that is not this user's alone: the message names the path and why."""


def _not_private(info: os.stat_result, directory: bool) -> str | None:
    """Why an entry with ``info`` is not this user's alone (StrictModes' rule), or None."""
    if info.st_uid != os.geteuid():
        return f"it is owned by uid {info.st_uid}, not by this user ({os.geteuid()})"
    if not directory and not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_mode & 0o022:
        return "it is writable by group or others (chmod go-w it)"
    if not directory and info.st_nlink > 1:
        return f"it has {info.st_nlink} names (a hard link)"
    return None


class PrivateDir(SafeDir):
    """A ``SafeDir`` trusted as OpenSSH's ``StrictModes`` trusts ``~/.ssh``: every directory walked, the root
    included, is owned by this user and writable by no one else (so no one else can have put or swapped
    anything in it), and every file read is this user's, writable by no one else, regular and single-linked.
    Otherwise the walk raises ``UntrustedDirError`` and a read ``ValueError``, naming why. New directories are
    made ``0o700``."""

    dir_mode = 0o700

    def _admit_dir(self, fd: int, where: Path) -> None:
        problem = _not_private(os.fstat(fd), directory=True)
        if problem:
            os.close(fd)
            raise UntrustedDirError(f"{where}: {problem}")

    def _admit_file(self, fd: int, where: Path) -> str | None:
        return _not_private(os.fstat(fd), directory=False)

    def problem(self, max_entries: int = 200_000, max_depth: int = MAX_DEPTH) -> str | None:
        """Why the tree below this directory is not this user's alone (a directory, file or link in it breaks
        the rule, or it holds more than ``max_entries`` entries or directories more than ``max_depth`` deep), or
        None; walked by descriptor, never through a link. ``FileNotFoundError`` when absent.

        Directories still to list are kept as names, not open descriptors, and each is re-opened from the root
        one component at a time: a cache of thousands of directories never runs out of descriptors."""
        try:
            top = self._open(create=False)
        except UntrustedDirError as e:
            return str(e)
        pending: list[tuple[str, ...]] = [()]  # directories to list, as components below the root
        seen = 0
        where = self.path
        try:
            while pending:
                below = pending.pop()
                where = self.path.joinpath(*below)
                if len(below) > max_depth:
                    return f"{where}: it is more than {max_depth} directories below {self.path}; clear it"
                fd = _reopen(top, below, where)
                try:
                    names = os.listdir(fd)
                    for name in names:
                        seen += 1
                        if seen > max_entries:
                            return f"{self.path}: it holds more than {max_entries} entries; clear it"
                        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        is_dir = stat.S_ISDIR(info.st_mode)
                        problem = _not_private(info, directory=is_dir)
                        if problem:
                            return f"{where / name}: {problem}"
                        if is_dir:
                            pending.append((*below, name))
                finally:
                    if fd != top:
                        os.close(fd)
        except UntrustedDirError as e:
            return str(e)
        except OSError as e:
            return f"{where}: {_why(e)}"
        finally:
            os.close(top)
        return None


def _reopen(top: int, below: tuple[str, ...], where: Path) -> int:
    """Directory ``below`` under ``top``, opened one real directory at a time (no link followed), each checked
    again: at most two descriptors besides ``top`` are open at once. ``top`` itself when ``below`` is empty."""
    fd = top
    try:
        for part in below:
            child = os.open(part, _DIR, dir_fd=fd)
            if fd != top:
                os.close(fd)
            fd = child
            problem = _not_private(os.fstat(fd), directory=True)
            if problem:
                raise UntrustedDirError(f"{where}: {problem}")
    except BaseException:
        if fd != top:
            os.close(fd)
        raise
    return fd
