"""Reading untrusted files: everything read from a run directory is data, never a path to obey
(docs/durability.md, "Threat model"). A file is read through no link, bounded in size, and nested at most
``MAX_DEPTH`` deep; YAML is checked from the parser's events before anything is constructed."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import yaml

#: How deeply lists and dicts may nest in a JSON or YAML file read from disk.
MAX_DEPTH = 64


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, opened through no symbolic link (a FIFO or device is not
    read either). ``ValueError`` saying why when it is not such a file or holds more than ``max_bytes``;
    ``OSError`` when it cannot be opened (``FileNotFoundError`` when absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError("it is a symbolic link, which csframework never writes") from e
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"it is larger than {max_bytes} bytes")
    return data


def _depth(value) -> int:
    """How deeply lists and dicts nest in ``value`` (iteratively: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def read_json(path: Path, max_bytes: int):
    """A JSON file read as untrusted data (``read_bounded``, nested at most ``MAX_DEPTH`` deep);
    ``ValueError`` saying what is wrong, ``OSError`` when it cannot be opened."""
    data = read_bounded(path, max_bytes)
    try:
        value = json.loads(data)
    except RecursionError:  # json's parser recurses once per level
        raise ValueError(f"it is nested deeper than {MAX_DEPTH} levels") from None
    if _depth(value) > MAX_DEPTH:
        raise ValueError(f"it is nested deeper than {MAX_DEPTH} levels")
    return value


def yaml_problem(text: str) -> str | None:
    """Why ``text`` is not a config csframework wrote (None if it could be), from the parser's events
    alone: nothing is constructed, so aliases (a YAML bomb) and deep nesting are caught before they cost."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                return "it uses YAML aliases, which csframework never writes"
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    return f"it is nested deeper than {MAX_DEPTH} levels"
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError as e:
        return f"it is not valid YAML ({' '.join(str(e).split())[:200]})"
    return None


# -- files ----------------------------------------------------------------------------------------------
