"""One job of a multirun, as any launcher runs it (in the launcher's process or in a worker process).

A job never ends the sweep: a failure is reported in one line naming the job and its overrides and the
job returns ``None`` (the Optuna sweeper counts a trial whose value is not a number as failed and goes
on; a NaN would make it fail itself); a stop signal finishes the step,
checkpoints, marks the sweep interrupted (``.interrupted`` in the sweep directory, which later jobs see and
do not start) and returns too. Either way the job's row is added to the sweep table as it ends. Under
``checkpoint.resume=auto`` a job whose run directory already says ``completed`` is not run again.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import structlog

from ..errors import CsfError
from ..process_state import clean_process_state
from ..signals import Interrupted, exit_status
from .table import make_row, override_columns, read_rows, record_row, row_overrides

INTERRUPTED = ".interrupted"
REFUSED = ".refused"  # jobs of this multirun not run because their run directory belongs to another sweep
JOBS = ".jobs"  # one file per job process running now (its pid), for the parent to forward signals to
PARENT_ENV = "CSFRAMEWORK_SWEEP_PARENT"  # the pid of the multirun's parent, inherited by worker processes


def interrupted_by(sweep_dir: Path) -> int | None:
    """The signal that interrupted the sweep in ``sweep_dir`` (this multirun), else ``None``."""
    try:
        return int((Path(sweep_dir) / INTERRUPTED).read_text() or signal.SIGINT)
    except (FileNotFoundError, ValueError):
        return None


def mark_interrupted(sweep_dir: Path, signum: int) -> None:
    path = Path(sweep_dir) / INTERRUPTED
    if not path.exists():
        path.write_text(str(int(signum)))


def read_summary(run_dir: Path, since: float = 0.0) -> dict | None:
    """``summary.json`` of ``run_dir`` if it was written at or after ``since`` (a time.time())."""
    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime >= since:
            return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    return None


def objective_of(summary: dict | None, objective: str) -> float | None:
    value = (summary or {}).get("metrics", {}).get(objective)
    return float(value) if value is not None else None


def describe(num: int, overrides: list[str]) -> str:
    return f"job {num} ({' '.join(overrides) or 'no overrides'})"


@contextlib.contextmanager
def _job_signals():
    """Outside ``Run.fit`` (which handles them itself) a stop signal interrupts the job's set-up at once;
    in a worker process the job also leaves the terminal's process group, so a Ctrl-C reaches it once,
    forwarded by the parent, not twice."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if os.environ.get(PARENT_ENV) not in (None, str(os.getpid())):
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)

    def interrupt(signum, frame):
        raise Interrupted(signum, 0)

    with handling_stop_signals(interrupt):
        yield


@contextlib.contextmanager
def handling_stop_signals(handler):
    """``handler`` for SIGINT and SIGTERM while active; the previous handlers afterwards."""
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _registered(sweep_dir: Path):
    """While the job runs, ``.jobs/<pid>`` names its process, so the parent can forward signals to it."""
    jobs = Path(sweep_dir) / JOBS
    jobs.mkdir(parents=True, exist_ok=True)
    me = jobs / str(os.getpid())
    me.touch()
    try:
        yield
    finally:
        me.unlink(missing_ok=True)


def _point(overrides: dict[str, str]) -> dict[str, str]:
    """What makes a job the same job on a rerun: its overrides, whether resuming or not aside."""
    return {k: v for k, v in overrides.items() if k != "checkpoint.resume"}


def default_threads(hydra_cfg) -> int | None:
    """Under a parallel launcher on one machine (joblib), each job's share of the cores."""
    n_jobs = hydra_cfg.launcher.get("n_jobs") if "n_jobs" in hydra_cfg.launcher else None
    if not n_jobs:
        return None
    cores = os.cpu_count() or 1
    parallel = cores if n_jobs < 0 else n_jobs  # joblib: -1 is every core
    return max(1, cores // max(1, parallel))


def run_sweep_job(cfg, run_job) -> float | None:
    """Run ``run_job(cfg, overrides)`` as job ``hydra.job.num`` of a multirun; returns its objective
    (``sweep.objective`` from its summary), ``None`` if it failed, was interrupted or never started."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    num, overrides = hc.job.num, list(hc.overrides.task)
    sweep_dir, run_dir = Path(hc.sweep.dir), Path(hc.runtime.output_dir)
    objective = str(cfg.get("sweep", {}).get("objective", "val/loss"))
    if interrupted_by(sweep_dir) is not None:
        return None  # the sweep was stopped before this job started: no row, nothing run
    if str(cfg.checkpoint.resume) == "auto":
        before = next((r for r in read_rows(sweep_dir) if r.get("job") == num), None)
        if before is not None and _point(row_overrides(before)) != _point(override_columns(overrides)):
            other = " ".join(f"{k}={v}" for k, v in row_overrides(before).items())
            sys.stderr.write(f"csframework: {describe(num, overrides)} failed: its run directory {run_dir} holds "
                             f"job {num} of another sweep ({other}); run this sweep in a new hydra.sweep.dir\n")
            with open(sweep_dir / REFUSED, "a") as f:  # the multirun exits 1; the other sweep's row stays
                f.write(f"{num}\n")
            return None
        done = read_summary(run_dir)
        if (done or {}).get("status") == "completed":
            sys.stderr.write(f"csframework: {describe(num, overrides)} completed before; not run again\n")
            return objective_of(done, objective)

    status, started = "failed", time.time()
    try:
        with _registered(sweep_dir), clean_process_state(), _job_signals(), \
                structlog.contextvars.bound_contextvars(job=num, sweep_dir=str(sweep_dir)):
            threads = default_threads(hc)
            if threads and not cfg.backend.get("threads"):
                torch.set_num_threads(threads)
            run_job(cfg, overrides)
        status = "completed"
    except KeyboardInterrupt as e:  # Interrupted: the step finished and a checkpoint was saved
        status = "interrupted"
        mark_interrupted(sweep_dir, getattr(e, "signum", signal.SIGINT))
        sys.stderr.write(f"csframework: {describe(num, overrides)} interrupted: {e}\n")
    except Exception as e:  # noqa: BLE001 - a failing job fails alone
        if cfg.get("debug", False):
            import traceback

            traceback.print_exc()
        message = str(e) if isinstance(e, CsfError) else f"{type(e).__name__}: {e}"
        sys.stderr.write(f"csframework: {describe(num, overrides)} failed: {' '.join(message.split())}\n")
    finally:
        summary = read_summary(run_dir, since=started)
        record_row(sweep_dir, make_row(num, overrides, status, summary, time.time() - started, run_dir))
    if status != "completed":
        return None
    value = objective_of(summary, objective)
    if value is None:
        sys.stderr.write(f"csframework: {describe(num, overrides)} has no metric {objective!r} for the sweeper "
                         f"(sweep.objective); it has: {', '.join((summary or {}).get('metrics', {})) or 'none'}\n")
    return value


def exit_status_of(sweep_dir: Path, rows: list[dict]) -> int:
    """0 when every job completed, 1 when any failed, 130/143 when the sweep was interrupted."""
    signum = interrupted_by(sweep_dir)
    if signum is not None:
        return exit_status(signum)
    refused = (Path(sweep_dir) / REFUSED).exists()
    return 1 if refused or any(r.get("status") != "completed" for r in rows) else 0
