"""Hostile sweep directories and signals (issue 27), through the CLI: a job directory linked to another run,
forged and FIFO summaries on resume, a SIGTERM during a job's final checkpoint, a NaN Optuna objective, and
joblib workers of a SIGKILLed multirun. Each multirun ends in bounded time without a traceback, and the
victim tree beside the sweep directory stays byte-identical (``hostile.Hostile``). In-process attacks on
the sweep directory's own files: tests/unit/test_sweep_hostile.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import needs, CONF, TINY
from hostile import SWEEP_TIMEOUT, Hostile, assert_bounded, assert_sweep_outcome, strict_json
from sweep_plugin import descendants

BASE = ["-m", "--config-dir", CONF, *[o for o in TINY if not o.startswith("optimizer.lr")], "loop.eval_steps=2"]


@pytest.fixture
def area(tmp_path, cli_env):
    h = Hostile(tmp_path)
    h.sweep = tmp_path / "sweep"
    h.sweep.mkdir()
    h.env = dict(cli_env, PYTHONPATH=f"{tmp_path / 'plugins'}{os.pathsep}{cli_env['PYTHONPATH']}")
    (tmp_path / "plugins").mkdir()
    return h


def multirun(h: Hostile, *overrides: str):
    return h.cli([*BASE, *overrides, f"hydra.sweep.dir={h.sweep}"], h.env, timeout=SWEEP_TIMEOUT)


def rows(sweep: Path) -> list[dict]:
    return strict_json((sweep / "sweep.json").read_text())


@pytest.mark.slow
def test_a_job_directory_linked_to_another_run_fails_that_job_alone(area):
    # before: job 1 trained in the other run's directory: its summary.json overwritten, its checkpoints pruned
    area.plant(area.sweep / "1", "symlink-dir")
    area.guard(area.sweep)
    out = multirun(area, "optimizer.lr=0.1,0.05")
    assert_sweep_outcome(out, area.sweep / "1")
    assert out.returncode == 1
    line = next(x for x in out.stderr.splitlines() if x.startswith("csframework: job 1 ("))
    assert "optimizer.lr=0.05" in line and f"failed: {area.sweep / '1'}: cannot use it as a directory" in line
    assert [(r["job"], r["status"]) for r in rows(area.sweep)] == [(0, "completed"), (1, "failed")]
    area.assert_untouched()


@pytest.mark.slow
def test_a_resumed_sweep_reruns_jobs_whose_summary_is_forged_or_a_fifo(area):
    # before: the forged "completed" skipped job 0 and reported val/loss 0.001; the FIFO hung the multirun
    forged = {"status": "completed", "global_step": 8, "metrics": {"val/loss": 0.001}}
    (area.sweep / "0").mkdir()
    (area.sweep / "0" / "summary.json").write_text(json.dumps(forged))
    area.plant(area.sweep / "1" / "summary.json", "fifo")
    area.plant(area.sweep / "sweep.json", "forged", content=b'[{"job": 0, "status": "completed"')
    area.guard(area.sweep)
    out = multirun(area, "optimizer.lr=0.1,0.05", "checkpoint.resume=auto")
    assert_bounded(out)
    assert out.returncode == 0, out
    err = out.stderr
    assert "sweep.json: it is not JSON" in err and "rebuilt from the job directories" in err
    assert "job 0 (" in err and "says completed but it has no checkpoints; running it again" in err
    assert "job 1 (" in err and "its summary.json is unusable (it is not a regular file)" in err
    assert "completed before" not in err
    table = rows(area.sweep)
    assert [(r["job"], r["status"], r["global_step"]) for r in table] == [(0, "completed", 8), (1, "completed", 8)]
    assert table[0]["val/loss"] != 0.001
    area.assert_untouched()


LATE_SIGNAL = '''
import os, signal
import csframework as csf

@csf.hookimpl
def on_checkpoint_save(run, state):
    """A SIGTERM to this process while job 0 writes its final checkpoint (the loop has ended)."""
    if run.config.optimizer.lr == 0.1 and run.global_step == run.config.loop.max_steps:
        os.kill(os.getpid(), signal.SIGTERM)
'''


@pytest.mark.slow
def test_a_sigterm_during_a_jobs_final_checkpoint_stops_the_sweep(area):
    # before: the signal was swallowed: job 1 started and the multirun exited 0
    (area.root / "plugins" / "late_signal.py").write_text(LATE_SIGNAL)
    area.guard(area.sweep)
    out = multirun(area, "optimizer.lr=0.1,0.05", "plugins.enable=[late_signal]")
    assert_bounded(out)
    assert out.returncode == 143, out
    assert [(r["job"], r["status"]) for r in rows(area.sweep)] == [(0, "interrupted")]
    assert not (area.sweep / "1" / "summary.json").exists()  # job 1 never ran
    assert "came during its final checkpoint" in out.stderr
    last = out.stderr.strip().splitlines()[-3:]
    assert last[0].startswith("csframework: sweep interrupted by SIGTERM") and "job 0 (" in last[1] and "optimizer.lr=0.1" in last[1]
    area.assert_untouched()


NAN_OBJECTIVE = '''
import csframework as csf

@csf.hookimpl
def on_train_batch_end(run):
    """``odd/objective``: NaN for the job with optimizer.lr=0.1, infinite for 0.2, 1/lr for the others."""
    lr = run.config.optimizer.lr
    run.report({"odd/objective": float("nan") if lr == 0.1 else float("inf") if lr == 0.2 else 1 / lr})
'''


@pytest.mark.slow
@needs("hydra_plugins.hydra_optuna_sweeper")
def test_a_nan_objective_is_a_failed_optuna_trial_and_the_study_goes_on(area):
    # before: Optuna's tell() refused the NaN and the sweeper ended the multirun with a traceback
    (area.root / "plugins" / "nan_objective.py").write_text(NAN_OBJECTIVE)
    area.guard(area.sweep)
    out = multirun(area, "hydra/sweeper=optuna", "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=3",
                   "hydra.sweeper.n_trials=6", "hydra.sweeper.n_jobs=1", "optimizer.lr=choice(0.1,0.2,0.05)",
                   "plugins.enable=[nan_objective]", "sweep.objective=odd/objective", "loop.max_steps=2")
    assert_bounded(out)
    assert out.returncode == 0, out
    table = rows(area.sweep)
    assert len(table) == 6 and {float(r["optimizer.lr"]) for r in table} == {0.1, 0.2, 0.05}
    assert out.stderr.count("the sweeper counts it as a failed trial") == sum(
        float(r["optimizer.lr"]) != 0.05 for r in table)
    assert {r["odd/objective"] for r in table if float(r["optimizer.lr"]) == 0.1} == {"NaN"}
    import yaml

    best = yaml.safe_load((area.sweep / "optimization_results.yaml").read_text())
    assert float(best["best_params"]["optimizer.lr"]) == 0.05 and best["best_value"] == pytest.approx(20.0)
    area.assert_untouched()


@pytest.mark.slow
@needs("hydra_plugins.hydra_joblib_launcher")
def test_joblib_workers_end_within_seconds_of_a_sigkilled_multirun(area):
    # before: the workers trained on, for as long as their jobs took, with no parent to report to
    env = dict(area.env, CSF_TEST_SLOW="0.1@0.05,0.05@0.05,0.01@0.05")
    proc = subprocess.Popen([sys.executable, "-m", "csframework", *BASE, "optimizer.lr=0.1,0.05,0.01",
                             "loop.max_steps=2000", "plugins.enable=[sweep_plugin]", "hydra/launcher=joblib",
                             "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={area.sweep}"],
                            env=env, cwd=area.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(os.listdir(area.sweep / ".jobs") if (
                area.sweep / ".jobs").is_dir() else []) < 2:
            time.sleep(0.2)
        assert len(os.listdir(area.sweep / ".jobs")) == 2, "the two jobs did not start"
        time.sleep(1)  # (a job may still be setting up: it is then interrupted there)
        family = [p for p in descendants(proc.pid) if p != proc.pid]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        left = family
        while left and time.monotonic() - killed < 20:
            time.sleep(0.2)
            left = [p for p in left if _alive(p)]
        assert not left, f"processes of the multirun alive {time.monotonic() - killed:.0f} s after its SIGKILL"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    # the jobs running then were stopped as a SIGTERM stops them: a checkpoint, "interrupted"
    statuses = {r["job"]: r["status"] for r in rows(area.sweep)}
    assert statuses and set(statuses.values()) == {"interrupted"}, statuses


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_completed_jobs_row_takes_its_metrics_from_its_checkpoint_not_its_summary(area):
    """Derived, not believed (issue 37): a rerun that skips a completed job reports the metrics its newest
    checkpoint holds. Before: the forged summary's val/loss 0.0001 became the job's row and objective."""
    assert multirun(area, "optimizer.lr=0.1,0.05").returncode == 0
    truth = json.loads((area.sweep / "0" / "summary.json").read_text())["metrics"]["val/loss"]
    summary = json.loads((area.sweep / "0" / "summary.json").read_text())
    summary["metrics"]["val/loss"] = 0.0001
    (area.sweep / "0" / "summary.json").write_text(json.dumps(summary))
    out = multirun(area, "optimizer.lr=0.1,0.05", "checkpoint.resume=auto")
    assert_bounded(out)
    assert out.returncode == 0, out
    line = next(x for x in out.stderr.splitlines() if x.startswith("csframework: job 0 ("))
    assert "optimizer.lr=0.1 " in line and line.endswith("completed before; not run again"), line
    assert [r["val/loss"] for r in rows(area.sweep) if r["job"] == 0] == [truth]


@pytest.mark.slow
def test_a_second_sweep_with_other_points_in_the_same_directory_is_refused_naming_the_first(area):
    """Two sweeps in one sweep directory (the second started before the first's rows were written: no
    sweep.json to compare with). Before: the second skipped its points as completed before and reported the
    first sweep's metrics as its own."""
    assert multirun(area, "optimizer.lr=0.1,0.05").returncode == 0
    (area.sweep / "sweep.json").unlink()
    (area.sweep / "sweep.csv").unlink()
    first = {n: json.loads((area.sweep / str(n) / "summary.json").read_text()) for n in (0, 1)}
    out = multirun(area, "optimizer.lr=0.2,0.3", "checkpoint.resume=auto")
    assert_bounded(out)
    assert out.returncode == 1, out.stderr[-5000:]
    assert "completed before" not in out.stderr
    for num, lr in ((0, "0.1"), (1, "0.05")):
        line = next(x for x in out.stderr.splitlines() if x.startswith(f"csframework: job {num} ("))
        assert f"holds the run of other overrides (optimizer.lr={lr}), another sweep's" in line, line
        assert json.loads((area.sweep / str(num) / "summary.json").read_text()) == first[num]  # the first's stays


@pytest.mark.slow
@needs("hydra_plugins.hydra_joblib_launcher")
def test_a_joblib_worker_killed_mid_sweep_ends_it_naming_the_job_with_a_row_for_every_job(area):
    """Issue 37: job 1's worker process is SIGKILLed (as by the OOM killer) once job 0 has completed (job 2
    may be starting in the other worker: loky then kills that one too; job 3 never runs). Before: the multirun died with joblib's
    TerminatedWorkerError traceback, no job named, and only job 0 in the table."""
    area.env = dict(area.env, CSF_TEST_KILL_WORKER="0.1@3", CSF_TEST_KILL_AFTER=str(area.sweep / "sweep.json"),
                    CSF_TEST_SLOW="0.05@0.2")
    out = multirun(area, "optimizer.lr=0.01,0.1,0.05,0.02", "plugins.enable=[sweep_plugin]", "hydra/launcher=joblib",
                   "hydra.launcher.n_jobs=2")
    assert_bounded(out)
    assert out.returncode == 1, out.stderr[-5000:]
    died = [x for x in out.stderr.splitlines() if x.startswith("csframework: a joblib worker process died")]
    assert len(died) == 1 and "job 1 (" in died[0] and "optimizer.lr=0.1 " in died[0], out
    table = {r["job"]: r for r in rows(area.sweep)}
    assert sorted(table) == [0, 1, 2, 3], table  # a row for every job
    assert table[0]["status"] == "completed" and isinstance(table[0]["val/loss"], float)  # kept
    assert table[1]["status"] == "failed" and table[1]["error"].startswith("its worker process died (exit codes")
    assert table[2]["status"] in ("failed", "interrupted") and table[3]["status"] == "interrupted"
    assert table[3]["error"].startswith("not run: a worker process died")
    assert any(x.startswith("  - job 1 (") for x in out.stderr.splitlines()), out  # the closing list of failures
    assert (area.sweep / "sweep.csv").read_text().count("\n") == 5
    assert not (area.sweep / ".jobs").exists()  # no stale entry left
