"""The live sweep table: ``sweep.json`` (a list of row objects, the source of truth) and ``sweep.csv`` in the
sweep directory, one row per job, added or replaced as each job ends.

Jobs may end at the same moment in parallel processes (joblib, submitit, Ray), so a row is written under
an exclusive lock of ``.sweep.lock`` in the sweep directory, and each file is replaced atomically (a
temporary file, then ``os.replace``): a reader always sees a complete, valid table.
"""
from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
from pathlib import Path

from ..files import write_text_atomic

TABLE_JSON, TABLE_CSV, LOCK = "sweep.json", "sweep.csv", ".sweep.lock"
#: Columns that follow the overridden keys, in this order; the metrics go between status and global_step.
HEAD, TAIL = ("job",), ("global_step", "wall_time_s", "run_dir")


def override_columns(overrides: list[str]) -> dict[str, str]:
    """``["optimizer.lr=0.1", "+x=1", "optimizer=sgd"]`` -> ``{"optimizer.lr": "0.1", "x": "1", ...}``
    (deletions, ``~key``, name no value and are left out)."""
    pairs = (o.split("=", 1) for o in overrides if "=" in o and not o.startswith("~"))
    return {key.lstrip("+"): value for key, value in pairs}


def row_overrides(row: dict) -> dict[str, str]:
    """The overridden keys of a row (those between ``job`` and ``status``) and their values."""
    keys = list(row)
    return {k: row[k] for k in keys[:keys.index("status")] if k not in HEAD}


def make_row(job: int, overrides: list[str], status: str, summary: dict | None, wall_time_s: float,
             run_dir: Path) -> dict:
    row: dict = {"job": job, **override_columns(overrides), "status": status}
    summary = summary or {}
    row.update(summary.get("metrics", {}))
    row.update(global_step=summary.get("global_step"), wall_time_s=round(wall_time_s, 3), run_dir=str(run_dir))
    return row


def read_rows(sweep_dir: Path) -> list[dict]:
    path = Path(sweep_dir) / TABLE_JSON
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []


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
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(sweep_dir) / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record_row(sweep_dir: Path, row: dict) -> list[dict]:
    """Add ``row`` to the table, replacing an earlier row of the same job (a rerun); returns all rows."""
    with locked(sweep_dir):
        rows = [r for r in read_rows(sweep_dir) if r.get("job") != row["job"]] + [row]
        rows.sort(key=lambda r: r["job"])
        write_table(sweep_dir, rows)
    return rows


def write_table(sweep_dir: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns(rows), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(Path(sweep_dir) / TABLE_CSV, text.getvalue())
    write_text_atomic(Path(sweep_dir) / TABLE_JSON, json.dumps(rows, indent=1, default=str) + "\n")
