"""One job of a multirun, as any launcher runs it (in the launcher's process or in a worker process).

A job never ends the sweep: a failure is reported in one line naming the job and its overrides and the job
returns ``None`` (Optuna counts a trial whose value is not a number as failed and goes on; a NaN or infinite
objective is returned as ``None`` too, since Optuna would fail on it); a stop signal finishes the step,
checkpoints, marks the sweep interrupted (``.interrupted`` in the sweep directory: later jobs do not start)
and returns too, also when it came during the job's final checkpoint. Either way its row goes into the table.

A failed job's directory holds its failure as a run's does: a job that failed before its run wrote anything
(its model, data or backend not built, its config refused) gets a ``fit_failed`` event in ``events.jsonl`` and
a ``summary.json`` with ``status: failed`` and the error, unless an earlier run's ``summary.json`` is there
(a rerun refused before it began must not overwrite it) or another run holds the directory.

Under ``checkpoint.resume=auto`` a job counts as completed before only when its ``summary.json`` is
well-formed, says ``completed`` and agrees with the job's own checkpoints (the newest is at the summary's
``global_step``) and its ``.hydra/overrides.yaml`` records the job's own overrides; its metrics are then
that checkpoint's (derived, not believed), plus its test sets' from the summary. Anything else is run again
with a one-line note, resuming from its checkpoints, or without any moving the records it holds into
``previous-runs/`` first; a job directory recording other overrides (another sweep's) is refused. Everything
in the sweep directory is read and written through ``files.SafeDir``: a job directory that is a link or not
a directory is refused for that job, before the run writes anything. In a worker process, a watchdog ends
the process when the multirun's parent is gone (``.watchdog``).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog
from omegaconf import OmegaConf

from .. import console_once
from ..config.sections import test_metrics
from ..errors import CsfError, ExitCode, RunDirHoldsRun, RunDirInUse, UnsafePathError, one_line, printable
from ..files import SafeDir
from ..jsonout import dumps
from ..process_state import clean_process_state
from ..signals import Interrupted, caught_stop_signal, exit_status, forget_stop_signals, signal_name
from ..summary_file import read_summary
from .marks import (INTERRUPTED, REFUSED, SAID, first_in_sweep, interrupted_by, mark_interrupted, refuse,
                    refused_jobs, reset_stop)
from .table import make_row, override_columns, read_rows, record_row, recorded_overrides, row_overrides
from .watchdog import PARENT_ENV, job_running, start_time, start_watchdog

JOBS = ".jobs"  # one file per job process running now (its pid), for the parent to forward signals to

_job_caught: list[int] = []  # the stop signals the running job's set-up caught (``_job_signals``)


def objective_of(summary: dict | None, objective: str) -> float | None:
    """The objective's value in a well-formed summary (``"NaN"`` and the infinities as floats)."""
    value = (summary or {}).get("metrics", {}).get(objective)
    return float(value) if value is not None else None


def describe(num: int, overrides: list[str]) -> str:
    return f"job {num} ({printable(' '.join(overrides)) or 'no overrides'})"


def _say(line: str) -> None:
    sys.stderr.write(f"csframework: {line}\n")


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
        _job_caught.append(signum)  # known even if the code it interrupts turns it into another error
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
def _registered(sweep_dir: Path, num: int):
    """While job ``num`` runs, ``.jobs/<pid>`` names its process (and holds its number), so the parent can
    forward signals to it and, when the worker dies, name the job it ran (``running_jobs``)."""
    jobs, me = SafeDir(sweep_dir).sub(JOBS), str(os.getpid())
    jobs.write(me, str(num), durable=False)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, CsfError):
            jobs.remove(me)


def dead_jobs(sweep_dir: Path) -> dict[int, int]:
    """The jobs whose process died while running them: ``{job number: pid}`` of the ``.jobs`` entries left
    by a process that is gone (a job that ends removes its entry). Those entries are removed."""
    found = {}
    try:
        jobs = SafeDir(sweep_dir).sub(JOBS, create=False)
        for name in jobs.names():
            if name.isdigit() and start_time(int(name)) is None:
                with contextlib.suppress(OSError, ValueError, CsfError):
                    text = jobs.read(name, 32).decode("ascii", "replace").strip()
                    if text.isdigit():
                        found[int(text)] = int(name)
                with contextlib.suppress(OSError, CsfError):
                    jobs.remove(name)
    except (OSError, CsfError):  # no .jobs (no job started) or not a real directory: none known
        pass
    return found


# -- a job ---------------------------------------------------------------------------------------------
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


def job_dir(sweep_dir: Path, run_dir: Path) -> SafeDir:
    """The job's run directory, checked to be a real directory reached through real directories from the
    sweep directory (``UnsafePathError`` naming it otherwise)."""
    sweep = os.path.abspath(sweep_dir)
    rel = os.path.relpath(os.path.abspath(run_dir), sweep)
    if rel == "." or rel.split(os.sep)[0] == "..":  # hydra.sweep.subdir outside the sweep: itself, at least
        return SafeDir(run_dir).sub(create=False)
    try:
        return SafeDir(sweep).sub(*rel.split(os.sep), create=False)
    except FileNotFoundError as e:
        raise UnsafePathError(f"{run_dir}: the job's run directory is missing") from e


def recorded_point(job: SafeDir) -> dict[str, str] | None:
    """The point (overrides, ``checkpoint.resume`` aside) the job directory's ``.hydra/overrides.yaml``
    records of the run that wrote it, or None when it records none."""
    recorded = recorded_overrides(job)
    return _point(override_columns(recorded)) if recorded else None


def completed_before(job: SafeDir, data: Any = None) -> tuple[dict | None, str | None]:
    """The job's summary if it shows a completed job that its own checkpoints confirm (the newest is named by the
    summary's ``global_step``, and its meta.json reads back), with that checkpoint's metrics (derived, not believed:
    a summary.json can be edited) and the summary's of ``data``'s test sets (measured after it, which it cannot
    hold); else None and, when the directory claims more than it shows, why."""
    from ..builtin.checkpoint import checkpoint_names, read_meta

    summary, problem = read_summary(job)
    if summary is None:
        return None, problem and f"its summary.json is unusable ({problem})"
    if summary["status"] != "completed":
        return None, None
    step = summary["global_step"]
    kind = job.kind("checkpoints")
    if kind != "dir":
        return None, ("its summary.json says completed but it has no checkpoints" if kind is None else
                      "its summary.json says completed but its checkpoints is not a real directory")
    root = job.path / "checkpoints"
    try:
        names, _ = checkpoint_names(root)
        if not names:
            return None, "its summary.json says completed but it has no checkpoint"
        if int(names[-1][len("step-"):]) != step:
            return None, (f"its summary.json says completed at step {step} but its newest checkpoint is "
                          f"{names[-1]}")
        meta = read_meta(root / names[-1])
    except (CsfError, ValueError, OSError) as e:  # DamagedCheckpoint, UnreadableCheckpoints
        return None, f"its checkpoints cannot confirm its summary.json ({printable(str(e))})"
    confirmed, tested = dict(meta.get("metrics") or {}), test_metrics(summary["metrics"], data) if data else {}
    return {**summary, "metrics": {**confirmed, **{k: v for k, v in tested.items() if k not in confirmed}}}, None


def run_sweep_job(cfg, run_job) -> float | None:
    """Run ``run_job(cfg, overrides)`` as job ``hydra.job.num`` of a multirun; returns its objective
    (``sweep.objective`` from its summary), ``None`` if it failed, was interrupted, never started or its
    objective is not a finite number."""
    try:
        start_watchdog()
        job_running.set()
        return _run_sweep_job(cfg, run_job)
    finally:
        job_running.clear()


def _run_sweep_job(cfg, run_job) -> float | None:
    import torch
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    num, overrides = hc.job.num, list(hc.overrides.task)
    sweep_dir, run_dir = Path(hc.sweep.dir), Path(hc.runtime.output_dir)
    objective = str(cfg.get("sweep", {}).get("objective", "val/loss"))
    if interrupted_by(sweep_dir) is not None:
        return None  # the sweep was stopped before this job started: no row, nothing run
    try:
        job = job_dir(sweep_dir, run_dir)
    except UnsafePathError as e:
        _say(f"{describe(num, overrides)} failed: {printable(str(e))}")
        _record(sweep_dir, make_row(num, overrides, "failed", None, 0.0, run_dir))
        return None
    if str(cfg.checkpoint.resume) == "auto":
        before = next((r for r in read_rows(sweep_dir) if r.get("job") == num), None)
        # (a row rebuilt from a job directory that lost its .hydra/overrides.yaml says nothing either way)
        if before is not None and _point(row_overrides(before)) and \
                _point(row_overrides(before)) != _point(override_columns(overrides)):
            other = printable(" ".join(f"{k}={v}" for k, v in row_overrides(before).items()))
            _say(f"{describe(num, overrides)} failed: its run directory {printable(str(run_dir))} holds job {num} "
                 f"of another sweep ({other}); run this sweep in a new hydra.sweep.dir")
            refuse(sweep_dir, num)  # the multirun exits 1; the other sweep's row stays
            return None
        recorded, point = recorded_point(job), _point(override_columns(overrides))
        if recorded is not None and recorded != point:
            other = printable(" ".join(f"{k}={recorded.get(k, '(unset)')}" for k in {**recorded, **point}
                                       if recorded.get(k) != point.get(k)))
            _say(f"{describe(num, overrides)} failed: its run directory {printable(str(run_dir))} holds the run "
                 f"of other overrides ({other}), another sweep's; run this sweep in a new hydra.sweep.dir")
            refuse(sweep_dir, num)  # the multirun exits 1; the other sweep's job and row stay
            return None
        done, why = completed_before(job, cfg.data)
        if done is not None and recorded is None:  # counted only as the run of this job's own overrides
            done, why = None, "its .hydra/overrides.yaml records no overrides to show it is this job's run"
        if done is not None:
            _say(f"{describe(num, overrides)} completed before; not run again")
            # its row is rewritten from what was verified (a lost, stale, forged or copied row says otherwise)
            wall = (before or {}).get("wall_time_s")
            _record(sweep_dir, make_row(num, overrides, "completed", done,
                                        wall if type(wall) in (int, float) else None, run_dir))
            return _objective(num, overrides, done, objective)
        if why:
            _say(f"{describe(num, overrides)}: {why}; running it again (from its checkpoints, if any)")
            if job.kind("checkpoints") is None:  # what it claims goes into previous-runs/, not mixed with the new
                OmegaConf.update(cfg, "checkpoint.start_over", True, force_add=True)

    status, started, failure = "failed", time.time(), None
    forget_stop_signals()
    _job_caught.clear()
    try:
        with _registered(sweep_dir, num), clean_process_state(), _job_signals(), \
                structlog.contextvars.bound_contextvars(job=num, sweep_dir=str(sweep_dir)):
            threads = default_threads(hc)
            if threads and not cfg.backend.get("threads"):
                torch.set_num_threads(threads)
            with console_once.shown_once_by(functools.partial(first_in_sweep, sweep_dir)):
                run_job(cfg, overrides)
        status = "completed"
        late = _signal_seen()
        if late is not None:  # it came after the last step: fit saved and completed, the sweep still stops
            status = "interrupted"
            mark_interrupted(sweep_dir, late)
            _say(f"{describe(num, overrides)} interrupted: {signal_name(late)} came during its final checkpoint "
                 "(the job completed); no further job starts")
    except KeyboardInterrupt as e:  # Interrupted: the step finished and a checkpoint was saved
        status = "interrupted"
        mark_interrupted(sweep_dir, getattr(e, "signum", signal.SIGINT))
        _say(f"{describe(num, overrides)} interrupted: {printable(getattr(e, 'reason', None) or str(e))}")
    except Exception as e:  # noqa: BLE001 - a failing job fails alone
        if cfg.get("debug", False):
            import traceback

            traceback.print_exc()
        message = printable(" ".join((str(e) if isinstance(e, CsfError) else f"{type(e).__name__}: {e}").split()))
        stop = _signal_seen()
        if stop is not None:  # the signal interrupted code that reported it as its own failure
            status = "interrupted"
            mark_interrupted(sweep_dir, stop)
            _say(f"{describe(num, overrides)} interrupted by {signal_name(stop)}: {message}")
        else:
            _say(f"{describe(num, overrides)} failed: {message}")
            failure = e
    finally:
        summary, _ = read_summary(job, since=started)
        if isinstance(failure, RunDirHoldsRun):  # nothing ran: the row of the run in its directory stays
            refuse(sweep_dir, num)
        else:
            if failure is not None and summary is None and not isinstance(failure, (RunDirInUse, UnsafePathError)):
                summary = _record_failure(job, cfg, failure, started, num, sweep_dir)
            _record(sweep_dir, make_row(num, overrides, status, summary, time.time() - started, run_dir))
    if status != "completed":
        return None
    return _objective(num, overrides, summary, objective)


def _record_failure(job: SafeDir, cfg, error: BaseException, started: float, num: int,
                    sweep_dir: Path) -> dict | None:
    """A failed job whose run did not record its failure (it failed before its run wrote anything: its
    model could not be built, say) gets what a failed run leaves: a ``<mode>_failed`` event appended to
    ``events.jsonl`` (unless its run logged since ``started``: then it logged its failure itself) and a
    ``summary.json`` with ``status: failed`` and the error on one line, unless one is there already (an
    earlier run's stays). Returns the summary written, else None; a directory that refuses costs one line."""
    from ..builtin.metrics import command_line

    mode = "validate" if str(cfg.get("mode", "fit")) == "validate" else "fit"
    stage = next(iter(cfg.get("stages") or {}), "main")
    run_id = uuid.uuid4().hex[:12]
    message = f"{type(error).__name__}: {one_line(error)}"
    try:
        if not _written_since(job, "events.jsonl", started):
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # as the logging plugin writes it
            event = {"event": f"{mode}_failed", "level": "error", "timestamp": now, "run_id": run_id,
                     "stage": stage, "step": 0, "job": num, "sweep_dir": str(sweep_dir), "error": message}
            with job.append("events.jsonl") as f:
                f.write(dumps(event, where=f"event {event['event']!r}") + "\n")
        if job.kind("summary.json") is not None:
            return None
        summary: dict = {"status": "failed", "mode": mode, "global_step": 0,
                         "device_type": str(cfg.get("device", {}).get("type", "")).upper(), "stage": stage,
                         "metrics": {}, "run_id": run_id, "command_line": command_line(), "error": message}
        job.write("summary.json", dumps(summary, indent=2, where="summary.json"))
        return summary
    except (OSError, CsfError) as e:
        _say(f"job {num}: its failure is not recorded in {printable(str(job.path))}: "
             f"{printable(' '.join(str(e).split()))}")
        return None


def _written_since(job: SafeDir, name: str, since: float) -> bool:
    """Whether ``name`` in the job's directory was written at or after ``since`` (a time.time())."""
    try:
        with job.opened(create=False) as fd:
            return os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime >= since
    except FileNotFoundError:
        return False


def _signal_seen() -> int | None:
    """The stop signal the job caught (in ``fit`` or in its set-up), if any."""
    return caught_stop_signal() or (_job_caught[-1] if _job_caught else None)


def _record(sweep_dir: Path, row: dict) -> None:
    """Add the job's row; a sweep directory that refuses it costs the row, not the job (one line)."""
    try:
        record_row(sweep_dir, row)
    except (OSError, CsfError) as e:
        _say(f"job {row['job']}: its row is not in the sweep table: {printable(' '.join(str(e).split()))}")


def _objective(num: int, overrides: list[str], summary: dict | None, objective: str) -> float | None:
    """The value for the sweeper: ``None`` (a failed trial) when the metric is missing or not finite."""
    value = objective_of(summary, objective)
    if value is None:
        names = ", ".join(printable(k) for k in (summary or {}).get("metrics", {})) or "none"
        _say(f"{describe(num, overrides)} has no metric {printable(objective)!r} for the sweeper "
             f"(sweep.objective); it has: {names}")
    elif not math.isfinite(value):
        _say(f"{describe(num, overrides)}: its {printable(objective)} is {value}; the sweeper counts it as a "
             "failed trial")
        return None
    return value


def exit_status_of(sweep_dir: Path, rows: list[dict]) -> ExitCode:
    """``OK`` when every job completed, ``FAILED`` when any failed or was refused, ``INTERRUPTED`` or
    ``TERMINATED`` when the sweep was stopped."""
    signum = interrupted_by(sweep_dir)
    if signum is not None:
        return exit_status(signum)
    try:
        refused = SafeDir(sweep_dir).kind(REFUSED) is not None
    except (OSError, CsfError):
        refused = True
    return ExitCode.FAILED if refused or any(r.get("status") != "completed" for r in rows) else ExitCode.OK


__all__ = ["INTERRUPTED", "JOBS", "PARENT_ENV", "REFUSED", "SAID", "completed_before", "dead_jobs", "describe",
           "first_in_sweep",
           "exit_status_of", "handling_stop_signals", "interrupted_by", "job_dir", "mark_interrupted",
           "run_sweep_job", "start_watchdog"]
