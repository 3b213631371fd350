"""``csframework.sweep.job``, one multirun job: each parallel job's share of the cores; forged, damaged or
stale summaries and job directories planted in a sweep directory count as no result (issue 27); a
non-finite objective is a failed trial; a worker exits soon after its multirun parent is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from omegaconf import OmegaConf

from hostile import deep_json
from sweep_dirs import GOOD, area, fake_job  # noqa: F401,F811 (area is a fixture)

from csframework.errors import ConfigError
from csframework.files import SafeDir
from csframework.sweep.job import (PARENT_ENV, _objective, _record_failure, completed_before, default_threads,
                                   interrupted_by, job_dir, objective_of)


def test_parallel_jobs_share_the_cores():
    cores = os.cpu_count()
    assert default_threads(OmegaConf.create({"launcher": {"n_jobs": 2}})) == max(1, cores // 2)
    assert default_threads(OmegaConf.create({"launcher": {"n_jobs": -1}})) == 1  # joblib: one job per core
    assert default_threads(OmegaConf.create({"launcher": {"_target_": "BasicLauncher"}})) is None


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
    d = fake_job(area.sweep, 0, summary if isinstance(summary, bytes) else None)
    if not isinstance(summary, bytes):
        area.plant(d / "summary.json", summary)
    area.guard(area.sweep)
    done, problem = completed_before(SafeDir(area.sweep, "0"))
    assert done is None and why in problem
    area.assert_untouched()


def test_a_summary_counts_only_with_its_final_checkpoint(tmp_path):
    import torch

    from csframework.builtin.checkpoint import write_checkpoint

    d = fake_job(tmp_path, 0, GOOD)
    root = d / "checkpoints"
    root.mkdir()
    write_checkpoint(root, "step-00000004", {"x": torch.zeros(1)}, {"global_step": 4}, "a: 1\n")
    done, problem = completed_before(SafeDir(tmp_path, "0"))
    assert done is None and "step 8" in problem and "step-00000004" in problem
    write_checkpoint(root, "step-00000008", {"x": torch.zeros(1)}, {"global_step": 8}, "a: 1\n")
    done, problem = completed_before(SafeDir(tmp_path, "0"))
    assert problem is None and done["global_step"] == 8
    (root / "step-00000008" / "meta.json").write_text('{"files": 7}')
    done, problem = completed_before(SafeDir(tmp_path, "0"))
    assert done is None and "cannot confirm" in problem and "no files table" in problem


def test_a_completed_job_keeps_its_test_sets_metrics_and_nothing_else_the_checkpoint_does_not_hold(tmp_path):
    """A job rerun with ``resume=auto`` is not run again; its row's metrics are its final checkpoint's, and its
    summary's metrics of the test sets the job's config names (measured after that checkpoint): a sweep
    with ``data.test`` and ``sweep.objective=test/loss`` lost them (``no job reported test/loss``)."""
    import json

    import torch

    from csframework.builtin.checkpoint import write_checkpoint

    summary = {"status": "completed", "global_step": 8,
               "metrics": {"val/loss": 0.25, "test/loss": 0.5, "shifted/loss": 0.75, "planted/loss": 9.0}}
    d = fake_job(tmp_path, 0, json.dumps(summary).encode())
    (d / "checkpoints").mkdir()
    write_checkpoint(d / "checkpoints", "step-00000008", {"x": torch.zeros(1)},
                     {"global_step": 8, "metrics": {"val/loss": 0.5}}, "a: 1\n")
    data = OmegaConf.create({"test": {"_target_": "x.Y"}, "test_sets": {"shifted": {"_target_": "x.Y"}}})
    done, problem = completed_before(SafeDir(tmp_path, "0"), data)
    assert problem is None
    assert done["metrics"] == {"val/loss": 0.5, "test/loss": 0.5, "shifted/loss": 0.75}  # the checkpoint's val/loss
    done, _ = completed_before(SafeDir(tmp_path, "0"), OmegaConf.create({"test": None, "test_sets": {}}))
    assert done["metrics"] == {"val/loss": 0.5}


def test_a_job_that_failed_before_its_run_began_records_it_but_keeps_an_earlier_summary(tmp_path):
    """Issue 29 item 6: the failure goes into the job's events.jsonl and a new summary.json (status failed, the
    error on one line); an earlier run's summary.json stays as it was (issue 27: a rerun refused before it
    began must not overwrite it)."""
    import json

    cfg = OmegaConf.create({"mode": "fit", "device": {"type": "cpu"}, "stages": {}})
    error = ConfigError("model: could not build my.Net:\nRuntimeError('bug')")
    fresh = tmp_path / "1"
    fresh.mkdir()
    written = _record_failure(SafeDir(fresh), cfg, error, time.time(), 1, tmp_path)
    summary = json.loads((fresh / "summary.json").read_text())
    assert written == summary and summary["status"] == "failed" and summary["global_step"] == 0
    assert summary["error"] == "ConfigError: model: could not build my.Net: RuntimeError('bug')"
    event = json.loads((fresh / "events.jsonl").read_text())
    assert (event["event"], event["level"], event["job"]) == ("fit_failed", "error", 1)
    assert event["error"] == summary["error"]

    earlier = fake_job(tmp_path, 0, GOOD)
    assert _record_failure(SafeDir(earlier), cfg, error, time.time(), 0, tmp_path) is None
    assert (earlier / "summary.json").read_bytes() == GOOD
    assert json.loads((earlier / "events.jsonl").read_text())["event"] == "fit_failed"


def test_a_job_directory_that_is_a_link_is_refused(area):
    area.plant(area.sweep / "1", "symlink-dir")
    area.plant(area.sweep / "2", "file")
    with pytest.raises(Exception, match=str(area.sweep / "1")):
        job_dir(area.sweep, area.sweep / "1")
    with pytest.raises(Exception, match=str(area.sweep / "2")):
        job_dir(area.sweep, area.sweep / "2")
    (area.sweep / "0").mkdir()
    assert job_dir(area.sweep, area.sweep / "0").path == area.sweep / "0"


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
        from csframework.sweep import watchdog
        watchdog.WATCHDOG_GRACE_S = 2.0
        signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], "a").write("term\\n"))
        watchdog.start_watchdog()
        if sys.argv[2] == "busy":
            watchdog.job_running.set()
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


def test_a_warning_every_job_would_repeat_is_shown_once_per_sweep(tmp_path):
    """The built-ins ask ``console_once.first_time`` (a low floor); a sweep's job answers it from the sweep
    directory's ``.said``, which every job of the sweep shares, in whatever process it runs."""
    import functools

    from csframework import console_once
    from csframework.sweep.marks import first_in_sweep

    assert console_once.first_time("warmup") and console_once.first_time("warmup")  # outside a sweep: always
    for job in range(2):
        with console_once.shown_once_by(functools.partial(first_in_sweep, tmp_path)):
            assert console_once.first_time("warmup") is (job == 0)
            assert console_once.first_time("other") is (job == 0)
    assert console_once.first_time("warmup")  # the sweep's jobs are over
    assert (tmp_path / ".said").read_text().split() == ["warmup", "other"]
