"""Reading a run directory's ``summary.json`` back (the metrics plugin writes it): as untrusted input,
bounded in size, checked to be what a run writes. The metrics plugin reads it on resume, the sweep table
for every job."""
from __future__ import annotations

import json
import os

from .errors import UnsafePathError
from .files import SafeDir
from .jsonout import NON_FINITE

#: The most a ``summary.json`` may hold when read back.
MAX_SUMMARY_BYTES = 16 << 20
#: The non-finite floats as ``jsonout`` writes them.
NON_FINITE_STRINGS = ("NaN", *NON_FINITE.values())


def summary_problem(summary: object) -> str | None:
    """What in a parsed ``summary.json`` is not what a run writes (``status`` a string, ``global_step`` an
    integer, ``metrics`` a table of numbers or the non-finite strings); None if nothing."""
    if not isinstance(summary, dict):
        return "it is not an object"
    if not isinstance(summary.get("status"), str):
        return "its status is not a string"
    if type(summary.get("global_step")) is not int or summary["global_step"] < 0:
        return "its global_step is not a non-negative integer"
    metrics = summary.get("metrics")
    if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and (type(v) in (int, float) or v in NON_FINITE_STRINGS) for k, v in metrics.items()):
        return "its metrics are not a table of numbers"
    return None


def read_summary(job_dir: SafeDir, since: float = 0.0) -> tuple[dict | None, str | None]:
    """A job's ``summary.json`` (written at or after ``since``, a time.time()) if it is well-formed, and
    what is wrong with it otherwise (None when it is absent or older)."""
    try:
        with job_dir.opened(create=False) as fd:
            if os.stat("summary.json", dir_fd=fd, follow_symlinks=False).st_mtime < since:
                return None, None
        data = job_dir.read("summary.json", MAX_SUMMARY_BYTES)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, UnsafePathError) as e:
        return None, f"{getattr(e, 'strerror', None) or e}"
    try:
        summary = json.loads(data)
    except RecursionError:
        return None, "it is nested too deeply"
    except ValueError as e:
        return None, f"it is not JSON ({e})"
    problem = summary_problem(summary)
    return (None, problem) if problem else (summary, None)
