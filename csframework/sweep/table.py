"""The live sweep table: ``sweep.json`` (a list of row objects) and ``sweep.csv`` in the sweep directory, one
row per job, added or replaced as each job ends.

Jobs may end at the same moment in parallel processes (joblib, submitit, Ray), so a row is written under
an exclusive lock of ``.sweep.lock`` in the sweep directory, and each file is replaced atomically: a reader
always sees a complete, valid table. Everything goes through ``files.SafeDir``: no link planted in the
sweep directory is followed.

The table is evidence, not truth: ``sweep.json`` is read bounded and checked (a list of flat rows with an
integer ``job`` and a known ``status``); anything else is reported in one line and the table is rebuilt
from the job directories (their ``summary.json`` and ``.hydra/overrides.yaml``), or started empty.
"""
from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
import math
import os
import re
import sys
from pathlib import Path

import yaml

from ..errors import UnsafePathError, printable
from ..files import SafeDir
from ..jsonout import dumps, jsonable
from ..summary_file import read_summary

TABLE_JSON, TABLE_CSV, LOCK = "sweep.json", "sweep.csv", ".sweep.lock"
#: Columns that follow the overridden keys, in this order; the metrics go between status and global_step.
HEAD, TAIL = ("job",), ("global_step", "wall_time_s", "run_dir")
STATUSES = ("completed", "failed", "interrupted")
#: The most ``sweep.json`` (and a job's ``overrides.yaml``) may hold when read back (``summary.json``:
#: ``summary_file.MAX_SUMMARY_BYTES``).
MAX_TABLE_BYTES = 64 << 20
MAX_OVERRIDES_BYTES = 1 << 20
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def override_columns(overrides: list[str]) -> dict[str, str]:
    """``["optimizer.lr=0.1", "+x=1", "optimizer=sgd"]`` -> ``{"optimizer.lr": "0.1", "x": "1", ...}``
    (deletions, ``~key``, name no value and are left out)."""
    pairs = (o.split("=", 1) for o in overrides if "=" in o and not o.startswith("~"))
    return {key.lstrip("+"): value for key, value in pairs}


def row_overrides(row: dict) -> dict[str, str]:
    """The overridden keys of a row (those between ``job`` and ``status``) and their values."""
    keys = list(row)
    return {k: row[k] for k in keys[:keys.index("status")] if k not in HEAD}


def make_row(job: int, overrides: list[str], status: str, summary: dict | None, wall_time_s: float | None,
             run_dir: Path | None) -> dict:
    """A row of the table; ``summary`` only if it passed ``summary_problem``."""
    row: dict = {"job": job, **override_columns(overrides), "status": status}
    summary = summary or {}
    row.update({k: v for k, v in summary.get("metrics", {}).items() if k not in (*HEAD, "status", *TAIL)})
    row.update(global_step=summary.get("global_step"),
               wall_time_s=None if wall_time_s is None else round(wall_time_s, 3),
               run_dir=None if run_dir is None else str(run_dir))
    return row


def _rows_problem(rows) -> str | None:
    """What in a parsed ``sweep.json`` is not a table this module writes; None if nothing."""
    if not isinstance(rows, list):
        return "it is not a list of rows"
    seen = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            return f"row {i} is not an object"
        job = row.get("job")
        if type(job) is not int or job < 0 or job in seen:
            return f"row {i} has no job number of its own"
        seen.add(job)
        if row.get("status") not in STATUSES or list(row).index("status") < list(row).index("job"):
            return f"row {i} has no status ({', '.join(STATUSES)}) after its job"
        if not all(v is None or isinstance(v, (str, int, float)) for v in row.values()):
            return f"row {i} holds a list or an object"
    return None


def load_rows(sweep_dir: Path) -> tuple[list[dict], str | None]:
    """The rows of ``sweep.json`` and what is wrong with it (None when it is right or absent; the rows
    are then ``[]``)."""
    try:
        data = SafeDir(sweep_dir).read(TABLE_JSON, MAX_TABLE_BYTES)
    except FileNotFoundError:
        return [], None
    except (OSError, ValueError, UnsafePathError) as e:  # a link, FIFO, directory, too large, unreadable
        return [], f"{getattr(e, 'strerror', None) or e}"
    try:
        rows = json.loads(data)
    except RecursionError:
        return [], "it is nested too deeply"
    except ValueError as e:
        return [], f"it is not JSON ({e})"
    problem = _rows_problem(rows)
    return ([], problem) if problem else (rows, None)


def read_rows(sweep_dir: Path) -> list[dict]:
    """The table's rows; when ``sweep.json`` is unreadable or not a table, one line says so and the rows
    are rebuilt from the job directories (``rebuild_rows``)."""
    rows, problem = load_rows(sweep_dir)
    if problem is None:
        return rows
    rows = rebuild_rows(sweep_dir)
    sys.stderr.write(f"csframework: {printable(str(Path(sweep_dir) / TABLE_JSON))}: {printable(problem)}; the table "
                     f"is rebuilt from the job directories ({len(rows)} rows)\n")
    return rows


def recorded_overrides(job_dir: SafeDir) -> list[str]:
    """The overrides a job directory's ``.hydra/overrides.yaml`` records (a list of strings), else []."""
    try:
        data = job_dir.sub(".hydra", create=False).read("overrides.yaml", MAX_OVERRIDES_BYTES)
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(data)):
            return []  # csframework writes no aliases; they are how a small YAML file expands to gigabytes
        overrides = yaml.safe_load(data)
    except (OSError, ValueError, UnsafePathError, yaml.YAMLError, RecursionError):
        return []  # absent, unreadable, a link, not YAML: the row lacks its overrides
    return overrides if isinstance(overrides, list) and all(isinstance(o, str) for o in overrides) else []


def rebuild_rows(sweep_dir: Path) -> list[dict]:
    """Rows for the job directories (``<sweep dir>/<n>``, real directories) that hold a well-formed
    ``summary.json`` of a finished job: what a lost ``sweep.json`` said, but for the wall times."""
    sweep = SafeDir(sweep_dir)
    rows = []
    for name in sweep.names():
        if not (name.isdigit() and name == str(int(name)) and sweep.kind(name) == "dir"):
            continue
        job_dir = SafeDir(sweep_dir, name)
        summary, _ = read_summary(job_dir)
        if summary is None or summary["status"] not in STATUSES:
            continue
        rows.append(make_row(int(name), recorded_overrides(job_dir), summary["status"], summary, None, job_dir.path))
    return sorted(rows, key=lambda r: r["job"])


def columns(rows: list[dict]) -> list[str]:
    """``job``, every overridden key, ``status``, every metric, ``global_step``, ``wall_time_s``, ``run_dir``
    (a row's keys are in that order: those before ``status`` were overridden, those after are metrics)."""
    overridden: dict = {}
    metrics: dict = {}
    for row in rows:
        keys = list(row)
        at = keys.index("status")
        overridden.update(dict.fromkeys(k for k in keys[:at] if k not in HEAD))
        metrics.update(dict.fromkeys(k for k in keys[at + 1:] if k not in TAIL))
    return [*HEAD, *overridden, "status", *metrics, *TAIL]


@contextlib.contextmanager
def locked(sweep_dir: Path):
    """The table's lock (``.sweep.lock``: a regular file with one name, opened through no link)."""
    fd = SafeDir(sweep_dir).lock_file(LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def record_row(sweep_dir: Path, row: dict) -> list[dict]:
    """Add ``row`` to the table, replacing an earlier row of the same job (a rerun); returns all rows."""
    with locked(sweep_dir):
        rows = [r for r in read_rows(sweep_dir) if r.get("job") != row["job"]] + [row]
        rows.sort(key=lambda r: r["job"])
        write_table(sweep_dir, rows)
    return rows


def csv_cell(value) -> str:
    """A value as a ``sweep.csv`` cell that no spreadsheet evaluates: text starting with ``=``, ``+``,
    ``-``, ``@``, a tab or a carriage return (a formula to Excel, LibreOffice and Google Sheets) gets a
    leading apostrophe, unless it is a plain number (``-0.5``, ``+1e-3``). Non-finite numbers are written as
    in ``sweep.json`` (``NaN``, ``Infinity``, ``'-Infinity``)."""
    if isinstance(value, float) and not math.isfinite(value):
        value = jsonable(value)
    text = "" if value is None else str(value)
    if text[:1] in ("=", "+", "-", "@", "\t", "\r") and not _PLAIN_NUMBER.fullmatch(text):
        return "'" + text
    return text


def varying_columns(rows: list[dict]) -> list[str]:
    """``columns(rows)`` without the overridden keys every job set to the same value (``loop.max_steps=100``
    given to the whole sweep): ``sweep.csv`` shows what the jobs differ in. A table of one row keeps them all."""
    names = columns(rows)
    if len(rows) < 2:
        return names
    overridden = names[len(HEAD):names.index("status")]
    constant = {name for name in overridden if len({json.dumps(row.get(name)) for row in rows}) == 1}
    return [name for name in names if name not in constant]


def write_table(sweep_dir: Path, rows: list[dict]) -> None:
    """Replace ``sweep.csv`` (the columns that vary, ``varying_columns``) and ``sweep.json`` (every column,
    strict JSON, ``jsonout``) with ``rows``."""
    names = varying_columns(rows)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow([csv_cell(name) for name in names])
    writer.writerows([csv_cell(row.get(name)) for name in names] for row in rows)
    sweep = SafeDir(sweep_dir)
    sweep.write(TABLE_CSV, text.getvalue())
    sweep.write(TABLE_JSON, dumps(rows, indent=1, where=TABLE_JSON) + "\n")


def job_files(sweep_dir: Path, row: dict) -> SafeDir | None:
    """The run directory a row names, through ``SafeDir``, when it lies inside the sweep directory (the table
    is not trusted to name files elsewhere); else None."""
    sweep = os.path.abspath(sweep_dir)
    rel = os.path.relpath(os.path.abspath(str(row.get("run_dir"))), sweep)
    if rel == "." or rel.split(os.sep)[0] == "..":
        return None
    return SafeDir(sweep, *rel.split(os.sep))
