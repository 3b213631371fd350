"""The sweep's last word (issue 39 item 6): one line with its jobs (completed, failed, skipped: completed
before and not run again), the best job by ``sweep.objective``/``sweep.direction`` with its overrides, and
where the table and the plot are."""
from __future__ import annotations

import json
import os
import time

import pytest

import csframework.sweep as sweep
from csframework.sweep import end_line


def job(sweep_dir, num: int, status: str, loss: float | None, optimizer: str, summary_age: float = 0.0) -> dict:
    run_dir = sweep_dir / str(num)
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": status}))
    stamp = time.time() - summary_age
    os.utime(run_dir / "summary.json", (stamp, stamp))
    return {"job": num, "optimizer": optimizer, "optimizer.lr": 0.01, "status": status, "val/loss": loss,
            "val/accuracy": None if loss is None else 1 - loss, "global_step": 3, "wall_time_s": 1.0,
            "run_dir": str(run_dir)}


@pytest.fixture
def rows(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "_STARTED", time.time() - 60)  # the multirun started a minute ago
    return [job(tmp_path, 0, "completed", 0.5, "sgd"), job(tmp_path, 1, "completed", 0.25, "adamw"),
            job(tmp_path, 2, "failed", None, "adam"),
            job(tmp_path, 3, "completed", 0.75, "sgd", summary_age=3600)]  # completed in an earlier multirun


def test_the_sweep_ends_with_its_counts_its_best_job_and_its_files(tmp_path, rows, monkeypatch):
    monkeypatch.setattr(sweep, "_OBJECTIVE", "val/loss")
    monkeypatch.setattr(sweep, "_MAXIMIZE", False)
    assert end_line(tmp_path, rows, tmp_path / "sweep.png") == (
        "csframework: sweep ended: 4 jobs (2 completed, 1 failed, 1 skipped); best job 1 (optimizer=adamw): "
        f"val/loss=0.25; table: {tmp_path / 'sweep.csv'}, plot: {tmp_path / 'sweep.png'}")


def test_the_best_job_follows_the_sweep_s_objective_and_direction(tmp_path, rows, monkeypatch):
    monkeypatch.setattr(sweep, "_OBJECTIVE", "val/accuracy")
    monkeypatch.setattr(sweep, "_MAXIMIZE", True)
    line = end_line(tmp_path, rows, None)
    assert "best job 1 (optimizer=adamw): val/accuracy=0.75; table: " in line
    assert line.endswith("sweep.csv")  # no plot was written


def test_a_sweep_where_no_job_reported_the_objective_says_so(tmp_path, rows, monkeypatch):
    monkeypatch.setattr(sweep, "_OBJECTIVE", "val/perplexity")
    assert "; no job reported val/perplexity; " in end_line(tmp_path, rows, None)


def test_a_row_naming_a_directory_outside_the_sweep_is_not_read(tmp_path, rows, monkeypatch):
    """The table is untrusted: a row whose run_dir lies elsewhere is never stat-ed as the job's (not skipped)."""
    outside = tmp_path.parent / "elsewhere"
    outside.mkdir(exist_ok=True)
    (outside / "summary.json").write_text("{}")
    os.utime(outside / "summary.json", (0, 0))
    rows[0]["run_dir"] = str(outside)
    assert "(2 completed, 1 failed, 1 skipped)" in end_line(tmp_path, rows, None)
