"""Hostile sweep directories (issue 27), in process: what is planted in a sweep directory (links, hard links,
FIFOs, directories for files, forged or damaged tables and summaries) deletes, overwrites, hangs or misleads
nothing, and everything outside the sweep directory stays byte-identical (``hostile.Hostile``). The CLI
multiruns over such directories: tests/e2e/test_sweep_hostile.py."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hostile import Hostile, deep_json, strict_json

from csframework.files import SafeDir
from csframework.sweep import SweepCallback
from csframework.sweep.job import PARENT_ENV, completed_before, interrupted_by, job_dir, objective_of, _objective
from csframework.sweep.table import (csv_cell, load_rows, make_row, read_rows, read_summary, record_row)


@pytest.fixture
def area(tmp_path):
    """A scratch area: ``sweep`` (under attack) beside a victim tree that must stay as it is."""
    h = Hostile(tmp_path)
    h.sweep = tmp_path / "sweep"
    h.sweep.mkdir()
    return h


def start_multirun(sweep: Path) -> None:
    """What the multirun's parent does first (the Hydra callback), then what Hydra's BasicSweeper does
    next: ``OmegaConf.save`` of the config to ``multirun.yaml`` (it follows links and truncates)."""
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "sweep": {"objective": "val/loss"}})
    SweepCallback().on_multirun_start(config)
    OmegaConf.save(config, sweep / "multirun.yaml")


def test_jobs_as_a_link_to_a_directory_is_refused_and_deletes_nothing(area, capsys):
    # before: the multirun's start deleted every file of the directory .jobs pointed at (exit 0)
    area.plant(area.sweep / ".jobs", "symlink-dir")
    area.guard(area.sweep)
    with pytest.raises(SystemExit) as e:
        start_multirun(area.sweep)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(area.sweep / ".jobs") in err[0]
    area.assert_untouched()


def test_stale_jobs_entries_are_removed_only_in_the_real_jobs_directory(area):
    jobs = area.sweep / ".jobs"
    jobs.mkdir()
    (jobs / "4242").write_text("")  # a job killed outright in an earlier multirun
    area.plant(jobs / "4343", "symlink-file")  # a link: removed, its target kept
    area.plant(jobs / "77", "dir")  # not something csframework writes there: left alone
    area.guard(area.sweep)
    start_multirun(area.sweep)
    assert sorted(os.listdir(jobs)) == ["77"] and (jobs / "77" / "keep.txt").is_file()
    area.assert_untouched()


@pytest.mark.parametrize("kind", ["symlink-file", "hardlink", "dangling"])
def test_multirun_yaml_planted_as_a_link_is_replaced_not_written_through(area, kind):
    # before: Hydra's OmegaConf.save wrote the config through the link (or truncated the hard link's file)
    area.plant(area.sweep / "multirun.yaml", kind)
    area.guard(area.sweep)
    start_multirun(area.sweep)
    path = area.sweep / "multirun.yaml"
    assert not path.is_symlink() and path.stat().st_nlink == 1
    assert OmegaConf.load(path).hydra.sweep.dir == str(area.sweep)
    area.assert_untouched()


@pytest.mark.parametrize("kind", ["symlink-file", "hardlink", "fifo"])
def test_a_lock_file_that_is_a_link_or_fifo_is_refused_in_one_line(area, capsys, kind):
    area.plant(area.sweep / ".sweep.lock", kind)
    area.guard(area.sweep)
    with pytest.raises(SystemExit) as e:
        start_multirun(area.sweep)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(area.sweep / ".sweep.lock") in err[0]
    area.assert_untouched()


@pytest.mark.parametrize("name", [".interrupted", "sweep.csv", "multirun.yaml"])
def test_a_directory_where_the_sweep_writes_a_file_is_refused_and_kept(area, capsys, name):
    area.plant(area.sweep / name, "dir")
    area.guard(area.sweep)
    with pytest.raises(SystemExit) as e:
        start_multirun(area.sweep)
    assert e.value.code == 2 and str(area.sweep / name) in capsys.readouterr().err
    area.assert_untouched()  # also: the planted directory still holds its own file


def test_optuna_results_planted_as_links_are_unlinked_before_the_study(area):
    area.plant(area.sweep / "optimization_results.yaml", "hardlink")
    area.guard(area.sweep)
    start_multirun(area.sweep)
    assert not (area.sweep / "optimization_results.yaml").exists()
    area.assert_untouched()


def _job(sweep: Path, num: int, summary: bytes | None, overrides=("optimizer.lr=0.1",)) -> Path:
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (d / "summary.json").write_bytes(summary)
    return d


GOOD = json.dumps({"status": "completed", "global_step": 8, "metrics": {"val/loss": 0.5, "odd": "NaN"}}).encode()


@pytest.mark.parametrize("table", [
    b"[[[[", deep_json(), b'"a string"', b'{"job": 0}', b'[{"job": "0", "status": "completed"}]',
    b'[{"job": 0, "status": "done"}]', b'[{"job": 0, "status": "completed", "x": [1]}]', "fifo", "symlink-file",
    "oversized"])
def test_a_damaged_table_is_rebuilt_from_the_job_directories_in_one_line(area, capsys, table):
    # before: a traceback (JSONDecodeError, RecursionError, KeyError, TypeError), a hang on a FIFO, or
    # another file's contents read as the table
    _job(area.sweep, 0, GOOD)
    _job(area.sweep, 1, b"not json")  # no well-formed summary: no row
    if isinstance(table, bytes):
        area.plant(area.sweep / "sweep.json", "forged", content=table)
    else:
        area.plant(area.sweep / "sweep.json", table, content=b"[]")
    area.guard(area.sweep)
    start = time.monotonic()
    start_multirun(area.sweep)
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sweep.json" in err[0] and "rebuilt from the job directories (1 rows)" in err[0]
    rows = strict_json((area.sweep / "sweep.json").read_text())
    assert rows == [{"job": 0, "optimizer.lr": "0.1", "status": "completed", "val/loss": 0.5, "odd": "NaN",
                     "global_step": 8, "wall_time_s": None, "run_dir": str(area.sweep / "0")}]
    assert read_rows(area.sweep) == rows and load_rows(area.sweep)[1] is None
    area.assert_untouched()


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


@pytest.mark.parametrize("summary,why", [
    (b'{"status": "completed", "global_step": 8, "metrics": {"val/loss": 0.1}}', "no checkpoints"),
    (deep_json(), "nested too deeply"),
    (b'{"status": "completed", "global_step": "8", "metrics": {}}', "global_step"),
    (b'{"status": "completed", "global_step": 8, "metrics": {"val/loss": "0.1"}}', "metrics"),
    (b'{"status": ["completed"], "global_step": 8, "metrics": {}}', "status"),
    (b'"completed"', "not an object"),
    ("fifo", "not a regular file"),
    ("symlink-file", "symbolic link"),
])
def test_a_forged_or_damaged_summary_does_not_count_as_completed(area, summary, why):
    # before: a forged "completed" summary skipped the job and reported its metric; the others gave a
    # traceback, and a FIFO a hang
    d = _job(area.sweep, 0, summary if isinstance(summary, bytes) else None)
    if not isinstance(summary, bytes):
        area.plant(d / "summary.json", summary)
    area.guard(area.sweep)
    done, problem = completed_before(SafeDir(area.sweep, "0"))
    assert done is None and why in problem
    area.assert_untouched()


def test_a_summary_counts_only_with_its_final_checkpoint(tmp_path):
    import torch

    from csframework.builtin.checkpoint import write_checkpoint

    d = _job(tmp_path, 0, GOOD)
    root = d / "checkpoints"
    root.mkdir()
    write_checkpoint(root, "step-00000004", {"x": torch.zeros(1)}, {"global_step": 4}, "a: 1\n")
    done, problem = completed_before(SafeDir(tmp_path, "0"))
    assert done is None and "step 8" in problem and "step-00000004" in problem
    write_checkpoint(root, "step-00000008", {"x": torch.zeros(1)}, {"global_step": 8}, "a: 1\n")
    done, problem = completed_before(SafeDir(tmp_path, "0"))
    assert problem is None and done["global_step"] == 8
    (root / "step-00000008" / "meta.json").write_text('{"files": {}, "global_step": 7}')
    done, problem = completed_before(SafeDir(tmp_path, "0"))
    assert done is None and "7" in problem


def test_a_job_directory_that_is_a_link_is_refused(area):
    area.plant(area.sweep / "1", "symlink-dir")
    area.plant(area.sweep / "2", "file")
    with pytest.raises(Exception, match=str(area.sweep / "1")):
        job_dir(area.sweep, area.sweep / "1")
    with pytest.raises(Exception, match=str(area.sweep / "2")):
        job_dir(area.sweep, area.sweep / "2")
    (area.sweep / "0").mkdir()
    assert job_dir(area.sweep, area.sweep / "0").path == area.sweep / "0"


def test_a_summary_older_than_the_job_is_not_its_result(tmp_path):
    d = _job(tmp_path, 0, GOOD)
    assert read_summary(SafeDir(tmp_path, "0"), since=time.time() + 60) == (None, None)
    assert read_summary(SafeDir(tmp_path, "0"))[0]["global_step"] == 8


def test_a_non_finite_objective_is_a_failed_trial_for_the_sweeper(capsys):
    # before: the NaN went to Optuna, whose tell() raised and ended the study with a traceback
    for value in ("NaN", "Infinity", float("nan"), float("-inf")):
        summary = {"status": "completed", "global_step": 1, "metrics": {"val/loss": value}}
        assert _objective(3, ["a=\x1b[31m"], summary, "val/loss") is None
    err = capsys.readouterr().err
    assert err.count("the sweeper counts it as a failed trial") == 4 and "\x1b" not in err
    assert objective_of({"metrics": {"val/loss": 0.25}}, "val/loss") == 0.25


def test_the_interrupted_mark_cannot_be_forged_into_a_crash(area):
    area.plant(area.sweep / ".interrupted", "forged", content=b"not a signal")
    assert interrupted_by(area.sweep) == signal.SIGINT  # something is there: the sweep stops
    (area.sweep / ".interrupted").write_text("15")
    assert interrupted_by(area.sweep) == signal.SIGTERM
    area.plant(area.sweep / ".interrupted", "fifo")
    assert interrupted_by(area.sweep) == signal.SIGINT  # not read (no hang)


def test_a_worker_exits_within_seconds_of_its_multirun_parent_being_killed(tmp_path):
    """The worker's watchdog: the parent (``CSFRAMEWORK_SWEEP_PARENT``) is SIGKILLed; an idle worker exits at
    once, a worker running a job gets a SIGTERM first (here it ignores it) and exits after the grace."""
    worker = textwrap.dedent("""
        import os, signal, sys, time
        from csframework.sweep import job
        job.WATCHDOG_GRACE_S = 2.0
        signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], "a").write("term\\n"))
        job.start_watchdog()
        if sys.argv[2] == "busy":
            job._job_running.set()
        open(sys.argv[1], "a").write("ready\\n")
        time.sleep(120)
    """)
    (tmp_path / "worker.py").write_text(worker)
    for mode in ("idle", "busy"):
        log = tmp_path / f"{mode}.log"
        parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        env = dict(os.environ, **{PARENT_ENV: str(parent.pid)})
        child = subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(log), mode], env=env)
        try:
            deadline = time.monotonic() + 60
            while not (log.exists() and "ready" in log.read_text()) and time.monotonic() < deadline:
                time.sleep(0.1)
            parent.kill()
            parent.wait()
            killed = time.monotonic()
            code = child.wait(timeout=30)
            waited = time.monotonic() - killed
        finally:
            child.kill()
        assert code == 143
        if mode == "idle":
            assert waited < 5 and "term" not in log.read_text()
        else:
            assert 1.5 < waited < 8 and "term" in log.read_text()


@pytest.mark.parametrize("kind", ["file", "fifo", "dangling", "symlink-file"])
def test_a_job_number_that_is_not_a_directory_is_refused_before_any_job(area, capsys, kind):
    # before: Hydra's launcher failed on it with a traceback (mkdir: File exists)
    area.plant(area.sweep / "1", kind)
    area.guard(area.sweep)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(area.sweep), "subdir": "${hydra.job.num}"}}})
    with pytest.raises(SystemExit) as e:
        SweepCallback().on_multirun_start(config)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and str(area.sweep / "1") in err[0]
    area.assert_untouched()
