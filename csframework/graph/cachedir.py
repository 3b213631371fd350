"""Compile caches trusted as OpenSSH trusts ``~/.ssh`` (docs/durability.md, "Compile caches").

What a compile cache holds is run, not just read: the whole step's Inductor artifacts are pickles, Inductor's
own cache holds generated Python modules and built libraries that it imports. So a cache root (``backend.compile_dir``,
``$TORCHINDUCTOR_CACHE_DIR`` or ``~/.cache/csframework/inductor``) is used only when the tree below it is this
user's alone (``privatedir.PrivateDir.problem``: every directory and file owned by the user and writable by no one
else, every file regular and single-linked), as ``StrictModes`` asks; Inductor's cache (``backend.compile=true``)
also only when this process can write there (Inductor fails the compile when it cannot write its entries; a
read-only ``backend.compile_dir`` is read, and what the CSX compiler cannot write there is not cached). Otherwise the run compiles
afresh into a private directory of its own, after one warning naming the cache and why, and reads and writes
nothing there.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Callable

from ..errors import CsfError
from ..privatedir import PrivateDir

#: Cache root -> the private directory used in its place by this process (the warning is given once).
_replacements: dict[str, Path] = {}


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def trusted_root(root: str | os.PathLike, warn: Callable[[str], None] | None = None, *,
                 writable: bool = False) -> Path:
    """``root`` (made, ``0o700``, when absent) if everything below it is this user's alone (and, with
    ``writable``, this process can create files in it: for Inductor, which fails the compile when it cannot
    write its cache); else a fresh private directory for this process (removed at exit), after one ``warn``
    naming ``root`` and why."""
    path = Path(os.path.abspath(os.path.expanduser(str(root))))
    key = str(path)
    if key in _replacements:
        return _replacements[key]
    try:
        tree = PrivateDir(path)
        tree.sub(create=True)  # made if absent, and its root checked
        problem = tree.problem()
    except (CsfError, OSError) as e:
        problem = str(e)
    fix = "make the cache yours alone, e.g. chmod -R go-w it, or point it at a directory of your own"
    if problem is None and writable:
        problem, fix = unwritable(path), "chmod u+w it, or point it at a directory you can write"
    if problem is None:
        return path
    private = Path(tempfile.mkdtemp(prefix="csframework-cache-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    _replacements[key] = private
    (warn or _warn)(f"compile cache {path} not used: {problem}; this run compiles afresh in {private} ({fix})")
    return private


def unwritable(path: Path) -> str | None:
    """Why this process cannot create a file in directory ``path`` (a cache the user owns but made read-only,
    an immutable or read-only mounted one: writing its entries would fail mid-compile), or None. Found by
    trying: a temporary file is created and removed (permission bits alone do not tell, for root)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".csframework-probe-", dir=path)
    except OSError as e:
        return f"{path}: it is not writable ({e.strerror or e})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


#: Inductor's cache directory variable, which torch reads when its compiler is first imported.
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def usable_inductor_env(warn: Callable[[str], None] | None = None) -> None:
    """Make ``$TORCHINDUCTOR_CACHE_DIR`` a directory torch can use before anything imports its compiler
    (building an optimizer does, with or without ``backend.compile``): torch creates it then, and a file, a
    FIFO or a path below a file there is a traceback from inside torch. Such a setting is replaced by
    ``trusted_root``'s private directory, after one warning naming it."""
    given = os.environ.get(INDUCTOR_ENV)
    if given and not os.path.isdir(given):
        os.environ[INDUCTOR_ENV] = str(trusted_root(given, warn))
