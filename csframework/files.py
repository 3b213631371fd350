"""The one file-system layer for run and sweep directories: every file csframework writes, appends to, locks,
reads back or removes there goes through :class:`SafeDir` (the guarantees and their limits:
docs/durability.md).

A run or sweep directory may be written by others (a shared scratch file system, a copied run), so nothing
found in it is obeyed:

- a directory is reached one real directory at a time from its root, each component opened with
  ``O_NOFOLLOW | O_DIRECTORY`` relative to its parent's descriptor: a link, a file or a FIFO where a
  directory should be is refused naming the path (``UnsafePathError``, exit 2), never followed;
- a new file is written under an unpredictable temporary name created exclusively (``O_EXCL``, so no
  planted name or link is reused), flushed, fsynced and renamed over its final name (a link planted there
  is replaced, not followed): it is its old version or its complete new one;
- a file appended to or locked is opened without following a link and without blocking, and used only if
  it is a regular file with no other name (a FIFO, device, directory or hard link is refused);
- a file read back is read bounded in size, through no link, regular files only;
- removal deletes directory entries only, walking trees by descriptor: a link is removed, never followed.

``privatedir.PrivateDir`` is the same layer for what csframework would *execute* from a directory (compile
caches: pickled artifacts, generated modules), trusted as OpenSSH's ``StrictModes`` trusts ``~/.ssh``.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path
from typing import IO, Iterator

from .errors import UnsafePathError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _why(e: OSError, path: Path | None = None) -> str:
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST) and path is not None:
        with contextlib.suppress(OSError):  # O_NOFOLLOW | O_DIRECTORY says ENOTDIR for a link too: look
            e = OSError(errno.ELOOP if os.path.islink(path) else errno.ENOTDIR, "")
    if e.errno == errno.ELOOP:
        return "it is a symbolic link, which csframework never creates; remove it"
    if e.errno == errno.ENOTDIR:
        return "it is not a directory; remove it or choose another directory"
    if e.errno in (errno.EISDIR, errno.ENOTEMPTY):
        return "it is a directory where csframework writes a file; remove it"
    if e.errno == errno.ENXIO:
        return "it is a FIFO or device, not a regular file; remove it"
    return f"{e.strerror or e}; check it and its permissions"


def _component(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a single path component: {name!r}")
    return name


class SafeDir:
    """A directory ``root/parts...`` reached through real directories only. ``root`` is the trusted start
    (the run or sweep directory the user named: its parents are the user's, but it may not itself be a
    link); every operation re-walks ``parts`` from it, so nothing swapped in since is trusted, and no
    descriptor is held between operations (nothing leaks into forked workers)."""

    def __init__(self, root: str | os.PathLike, *parts: str):
        self.root = Path(root)
        self.parts = tuple(_component(p) for p in parts)

    @property
    def path(self) -> Path:
        return self.root.joinpath(*self.parts)

    def __truediv__(self, name: str) -> Path:
        """The path of entry ``name`` (for messages and for readers outside this layer)."""
        return self.path / _component(name)

    def __repr__(self) -> str:
        return f"SafeDir({str(self.path)!r})"

    def sub(self, *names: str, create: bool = True) -> SafeDir:
        """The directory ``names`` below this one, checked (and, with ``create``, made) now."""
        child = type(self)(self.root, *self.parts, *names)
        with child.opened(create=create):
            pass
        return child

    @contextlib.contextmanager
    def opened(self, create: bool = True) -> Iterator[int]:
        """A descriptor of this directory, walked from the root (made, with its parents, if ``create``)."""
        fd = self._open(create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open(self, create: bool) -> int:
        where = self.root
        try:
            if create and not self.root.is_dir():
                self.root.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.root, self.dir_mode)
            fd = os.open(self.root, _DIR)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise UnsafePathError(f"{where}: cannot use it as a directory ({_why(e, where)})") from e
        self._admit_dir(fd, where)
        for part in self.parts:
            where = where / part
            try:
                try:
                    child = os.open(part, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, self.dir_mode, dir_fd=fd)
                    child = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                raise
            except OSError as e:
                os.close(fd)
                raise UnsafePathError(f"{where}: cannot use it as a directory ({_why(e, where)})") from e
            os.close(fd)
            fd = child
            self._admit_dir(fd, where)
        return fd

    #: The mode of the directories this layer makes (before the umask).
    dir_mode = 0o755

    def _admit_dir(self, fd: int, where: Path) -> None:
        """Check directory ``fd`` (at ``where``) before anything in it is used: any real directory will do
        here; ``PrivateDir`` asks more. Closes ``fd`` when it raises."""

    def _admit_file(self, fd: int, where: Path) -> str | None:
        """Why regular-or-not file ``fd`` (at ``where``) must not be read, or None."""
        return None if stat.S_ISREG(os.fstat(fd).st_mode) else "it is not a regular file"

    # -- writing ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def atomic(self, name: str, durable: bool = True) -> Iterator[IO[bytes]]:
        """A new binary file that replaces ``name`` when the block ends without an error (and is removed
        when it raises): readers see the old file or the complete new one."""
        name = _component(name)
        with self.opened() as fd:
            for _ in range(100):
                tmp = f".{name[:64]}.{secrets.token_hex(8)}.tmp"
                try:
                    tmp_fd = os.open(tmp, _NEW, 0o644, dir_fd=fd)
                    break
                except FileExistsError:
                    continue
                except OSError as e:  # a read-only or immutable directory, say
                    raise UnsafePathError(f"{self / name}: cannot write it (a new file in {self.path}: "
                                          f"{_why(e)})") from e
            else:  # pragma: no cover - 100 collisions of 64 random bits
                raise UnsafePathError(f"{self / name}: cannot create a temporary file beside it")
            try:
                with os.fdopen(tmp_fd, "wb") as f:
                    yield f
                    f.flush()
                    if durable:
                        os.fsync(f.fileno())
                try:
                    os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
                except OSError as e:  # a directory planted at the name, say
                    raise UnsafePathError(f"{self / name}: cannot replace it ({_why(e, self / name)})") from e
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise
            if durable:
                os.fsync(fd)

    def write(self, name: str, data: bytes | str, durable: bool = True) -> Path:
        """Replace ``name`` with ``data`` (text is written as UTF-8) atomically; returns its path."""
        with self.atomic(name, durable) as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        return self / name

    def append(self, name: str) -> IO[str]:
        """``name`` opened for appending lines of text (created if absent): a regular file with no other name.
        A last line left unended (a process killed mid-write, or planted) is ended first, so that what is
        appended starts a line of its own rather than being glued to it."""
        fd = self._open_file(name, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                os.write(fd, b"\n")
        except OSError:
            os.close(fd)
            raise
        return os.fdopen(fd, "a", encoding="utf-8", newline="")

    def lock_file(self, name: str) -> int:
        """A read-write descriptor of ``name`` (created if absent) for ``flock``: a regular file with no
        other name, which is never truncated by opening it."""
        return self._open_file(name, os.O_RDWR | os.O_CREAT)

    def _open_file(self, name: str, flags: int) -> int:
        name = _component(name)
        with self.opened() as fd:
            try:
                file_fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644, dir_fd=fd)
            except OSError as e:
                raise UnsafePathError(f"{self / name}: cannot open it ({_why(e)})") from e
        info = os.fstat(file_fd)
        problem = ("it is not a regular file (a FIFO, device or directory); remove it"
                   if not stat.S_ISREG(info.st_mode) else
                   f"it has {info.st_nlink} names (a hard link), so writing it would change another file; "
                   "remove it" if info.st_nlink > 1 else None)
        if problem:
            os.close(file_fd)
            raise UnsafePathError(f"{self / name}: {problem}")
        fcntl.fcntl(file_fd, fcntl.F_SETFL, fcntl.fcntl(file_fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return file_fd

    def private_dir(self, prefix: str, mode: int = 0o700) -> SafeDir:
        """A new directory with an unpredictable name (``.<prefix>.<16 hex digits>``), created exclusively
        and writable by this user only: no one else's file or link can be in it when it is handed out."""
        with self.opened() as fd:
            while True:
                name = f".{_component(prefix)}.{secrets.token_hex(8)}"
                try:
                    os.mkdir(name, mode & 0o755, dir_fd=fd)
                    return type(self)(self.root, *self.parts, name)
                except FileExistsError:
                    continue

    def rename(self, src: str, dst: str) -> None:
        """Rename entry ``src`` to ``dst`` in this directory (an entry at ``dst`` is replaced, not followed;
        a non-empty directory there makes it fail)."""
        with self.opened() as fd:
            os.rename(_component(src), _component(dst), src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)

    def fsync(self) -> None:
        """Make the entries of this directory (renames into it) durable."""
        with self.opened() as fd:
            os.fsync(fd)

    # -- reading ----------------------------------------------------------------------------------------
    def reader(self, name: str) -> IO[bytes]:
        """Regular file ``name`` opened for reading through no link, without blocking on a FIFO.
        ``ValueError`` saying why when it is not such a file; ``OSError`` when it cannot be opened
        (``FileNotFoundError`` when absent, or when this directory is)."""
        name = _component(name)
        with self.opened(create=False) as fd:
            try:
                file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ValueError("it is a symbolic link, which csframework never writes") from e
                raise
        problem = self._admit_file(file_fd, self / name)
        if problem:
            os.close(file_fd)
            raise ValueError(problem)
        return os.fdopen(file_fd, "rb")

    def read(self, name: str, max_bytes: int) -> bytes:
        """The bytes of regular file ``name`` (``reader``); ``ValueError`` also when it holds more than
        ``max_bytes``."""
        with self.reader(name) as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"it is larger than {max_bytes} bytes")
        return data

    def kind(self, name: str) -> str | None:
        """What entry ``name`` is, without following it: ``file``, ``dir``, ``link``, ``other`` or None."""
        try:
            with self.opened(create=False) as fd:
                mode = os.stat(_component(name), dir_fd=fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
        return ("file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode)
                else "link" if stat.S_ISLNK(mode) else "other")

    def names(self) -> list[str]:
        """The entries of this directory (none when it does not exist)."""
        try:
            with self.opened(create=False) as fd:
                return os.listdir(fd)
        except FileNotFoundError:
            return []

    # -- removing ---------------------------------------------------------------------------------------
    def remove(self, name: str) -> None:
        """Delete entry ``name``: a file or link (never followed), or a directory tree walked by descriptor
        (links in it are removed, not followed). Absent is fine."""
        name = _component(name)
        try:
            with self.opened(create=False) as fd:
                _remove_entry(fd, name)
        except FileNotFoundError:
            pass


def _remove_entry(parent: int, name: str) -> None:
    """Remove ``name`` in directory ``parent``: iteratively, so no depth of a planted tree overflows."""
    stack: list[tuple[int, str, int | None]] = [(parent, name, None)]  # (dir fd, entry, fd of entry if a dir)
    opened: list[int] = []
    try:
        while stack:
            dir_fd, entry, entry_fd = stack.pop()
            if entry_fd is not None:  # its contents are gone: remove the directory itself
                os.close(entry_fd)
                opened.remove(entry_fd)
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(entry, dir_fd=dir_fd)
                continue
            try:
                child = os.open(entry, _DIR, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry, dir_fd=dir_fd)  # a file or a link: the entry goes, nothing it names
                continue
            opened.append(child)
            stack.append((dir_fd, entry, child))
            stack.extend((child, inner, None) for inner in os.listdir(child))
    finally:
        for fd in opened:
            os.close(fd)


# -- trusted paths ------------------------------------------------------------------------------------------
def write_text_atomic(path: str | os.PathLike, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` atomically (``SafeDir.write`` in its directory, whose own path is the
    caller's and is resolved: for caches and reports outside run directories)."""
    path = Path(path)
    SafeDir(os.path.realpath(path.parent)).write(path.name, text, durable)


def write_json_atomic(path: str | os.PathLike, data, durable: bool = True) -> None:
    """``data`` as indented strict JSON (``jsonout.dumps``), written as ``write_text_atomic`` does."""
    from .jsonout import dumps

    write_text_atomic(path, dumps(data, indent=2), durable)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
