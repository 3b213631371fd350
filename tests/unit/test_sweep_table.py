"""``csframework.sweep.table``, the sweep's results table: a row per job, replaced on a rerun, the columns in
order; strict JSON and neutralised formula cells; a summary older than its job is not its result."""
from __future__ import annotations

import csv
import time

from hostile import strict_json
from sweep_dirs import GOOD, fake_job

from csframework.files import SafeDir
from csframework.summary_file import read_summary
from csframework.sweep.table import columns, csv_cell, make_row, read_rows, record_row


def test_a_row_per_job_replaced_on_rerun_with_the_columns_in_order(tmp_path):
    record_row(tmp_path, make_row(1, ["optimizer.lr=0.1"], "failed", None, 1.0, tmp_path / "1"))
    record_row(tmp_path, make_row(0, ["optimizer.lr=0.2", "+extra=1"], "completed",
                                  {"metrics": {"val/loss": 0.5}, "global_step": 8}, 2.0, tmp_path / "0"))
    rows = record_row(tmp_path, make_row(1, ["optimizer.lr=0.1"], "completed",
                                         {"metrics": {"val/loss": 0.4}, "global_step": 8}, 3.0, tmp_path / "1"))
    assert [(r["job"], r["status"]) for r in rows] == [(0, "completed"), (1, "completed")] == [
        (r["job"], r["status"]) for r in read_rows(tmp_path)]
    assert columns(rows) == ["job", "optimizer.lr", "extra", "status", "val/loss", "global_step", "wall_time_s",
                             "run_dir"]
    assert (tmp_path / "sweep.csv").read_text().splitlines()[0] == ",".join(columns(rows))


def test_the_table_is_strict_json_and_formula_cells_are_neutralised(tmp_path):
    evil = {"optimizer.lr": "-0.5", "+x": "=HYPERLINK(\"http://evil\")", "y": "@SUM(A1)", "z": "+1e-3", "w": "-cmd"}
    overrides = [f"{k}={v}" for k, v in evil.items()]
    record_row(tmp_path, make_row(0, overrides, "completed",
                                  {"global_step": 3, "metrics": {"=bad": float("nan"), "val/loss": float("-inf")}},
                                  1.0, tmp_path / "0"))
    rows = strict_json((tmp_path / "sweep.json").read_text())
    assert rows[0]["=bad"] == "NaN" and rows[0]["val/loss"] == "-Infinity"  # strict JSON, the value kept
    with open(tmp_path / "sweep.csv", newline="") as f:
        header, row = list(csv.reader(f))
    cells = dict(zip(header, row))
    assert cells["optimizer.lr"] == "-0.5" and cells["z"] == "+1e-3"  # plain numbers stay numbers
    assert cells["x"] == "'=HYPERLINK(\"http://evil\")" and cells["y"] == "'@SUM(A1)" and cells["w"] == "'-cmd"
    assert "'=bad" in header and cells["'=bad"] == "NaN" and cells["val/loss"] == "'-Infinity"
    assert [csv_cell(v) for v in ("\tx", "\rx", "1.5", "-2", "", None, "a=b")] == ["'\tx", "'\rx", "1.5", "-2", "",
                                                                                    "", "a=b"]


def test_a_summary_older_than_the_job_is_not_its_result(tmp_path):
    d = fake_job(tmp_path, 0, GOOD)
    assert read_summary(SafeDir(tmp_path, "0"), since=time.time() + 60) == (None, None)
    assert read_summary(SafeDir(tmp_path, "0"))[0]["global_step"] == 8


def test_sweep_csv_leaves_out_the_settings_every_job_shares(tmp_path):
    """Issue 50 item 5: ``loop.max_steps=5`` given to the whole sweep is no column of ``sweep.csv`` (what the
    jobs differ in is); ``sweep.json`` keeps every setting."""
    for job, lr in enumerate(("0.1", "0.2")):
        rows = record_row(tmp_path, make_row(job, [f"optimizer.lr={lr}", "loop.max_steps=5"], "completed",
                                             {"metrics": {"val/loss": 0.5}, "global_step": 5}, 1.0, tmp_path / str(job)))
    with open(tmp_path / "sweep.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header == ["job", "optimizer.lr", "status", "val/loss", "global_step", "wall_time_s", "run_dir"]
    assert [row["loop.max_steps"] for row in read_rows(tmp_path)] == ["5", "5"] == [r["loop.max_steps"] for r in rows]
