"""``csframework.sweep``, the multirun callback: hostile sweep directories (issue 27), in process. What is
planted in a sweep directory (links, hard links, FIFOs, directories for files, damaged tables) deletes,
overwrites, hangs or misleads nothing, and everything outside the sweep directory stays byte-identical
(``hostile.Hostile``). The jobs' side: test_sweep_job.py; the table: test_sweep_table.py; the CLI multiruns
over such directories: tests/e2e/test_sweep_hostile_runs.py."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hostile import deep_json, strict_json
from sweep_dirs import GOOD, area, fake_job  # noqa: F401,F811 (area is a fixture)

from csframework.sweep_callback import SweepCallback
from csframework.sweep.table import load_rows, read_rows


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


@pytest.mark.parametrize("table", [
    b"[[[[", deep_json(), b'"a string"', b'{"job": 0}', b'[{"job": "0", "status": "completed"}]',
    b'[{"job": 0, "status": "done"}]', b'[{"job": 0, "status": "completed", "x": [1]}]', "fifo", "symlink-file",
    "oversized"])
def test_a_damaged_table_is_rebuilt_from_the_job_directories_in_one_line(area, capsys, table):
    # before: a traceback (JSONDecodeError, RecursionError, KeyError, TypeError), a hang on a FIFO, or
    # another file's contents read as the table
    fake_job(area.sweep, 0, GOOD)
    fake_job(area.sweep, 1, b"not json")  # no well-formed summary: no row
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


def test_the_sweeps_own_processes_end_with_it_and_no_other():
    """Issue 47 (15): after the last job, a process started under this multirun that ignores SIGTERM (as the
    resource trackers do) is killed after the grace; a process of the same parent without the multirun's mark
    in its environment is left alone."""
    import subprocess
    import sys

    from csframework.sweep import leftovers
    from csframework.sweep.job import PARENT_ENV

    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
                "time.sleep(60)")
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    ours = subprocess.Popen([sys.executable, "-c", stubborn], env={**env, PARENT_ENV: str(os.getpid())},
                            stdout=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", stubborn], env=env, stdout=subprocess.PIPE)
    try:
        ours.stdout.readline(), other.stdout.readline()  # both started, SIGTERM ignored
        assert leftovers.sweep_processes(os.getpid()) == [ours.pid]
        killed = leftovers.end_sweep_processes(os.getpid(), grace=0.3)
        assert killed == [f"{ours.pid} ({(sys.executable + ' -c ' + stubborn)[:80]})"]
        ours.wait(timeout=10)  # reaped already by end_sweep_processes, as the multirun reaps the trackers it started
        assert leftovers.sweep_processes(os.getpid()) == [] and other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()
