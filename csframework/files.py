"""Atomic file writes: a file csframework writes is either its old version or its complete new one.

Every file is written under a temporary name in the same directory (``<name>.tmp-<pid>``, never through a
symbolic link planted there), flushed and fsynced, then renamed over
the target (``os.replace`` is atomic on POSIX and Windows); ``fsync_dir`` makes a rename itself durable.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written.

    ``durable=False`` skips the fsync for files that may be lost on a power cut but must never be torn
    (caches, reports)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)  # a planted link: refused
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str | os.PathLike, data: Any, durable: bool = True) -> None:
    """``data`` as indented JSON (non-JSON values as ``str``), written as ``write_text_atomic`` does."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str), durable)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
