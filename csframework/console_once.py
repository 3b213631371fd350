"""Console warnings shown once per group of runs. Each job of a multirun would repeat a warning (a default
too long for a short run, say): while a job runs, the sweep (``sweep.job``, which keeps the record in its
sweep directory) says which warnings were shown already, and the built-ins ask ``first_time`` — an
interface on a low floor, so that no built-in imports the sweep. Outside a group every warning is shown."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

_groups: list[Callable[[str], bool]] = []  # the group of the run in this process, while it runs


def first_time(key: str) -> bool:
    """Whether the warning ``key`` is shown on the console now: the first time in its group of runs
    (always outside a group). Every run still records it in its own ``events.jsonl``."""
    return _groups[-1](key) if _groups else True


@contextlib.contextmanager
def shown_once_by(first: Callable[[str], bool]) -> Iterator[None]:
    """While the block runs, ``first(key)`` decides ``first_time(key)`` (records the key, says whether it
    was new)."""
    _groups.append(first)
    try:
        yield
    finally:
        _groups.remove(first)
