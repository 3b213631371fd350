"""Multirun sweeps that survive failing jobs, interrupts and reruns (see docs/guides/sweeps.md).

- :mod:`.job`: one job as any launcher runs it (failure isolation, signals, skip when completed, its row);
- :mod:`.table`: the live ``sweep.csv`` / ``sweep.json``;
- :mod:`.plot`: ``sweep.png``;
- :mod:`.leftovers`: the sweep's own processes (launcher helpers, resource trackers) ended with it;
- here: what the multirun's parent process does: its start (``start``, called by the Hydra callback
  ``csframework.sweep_callback`` that ``conf/config.yaml`` registers),
  forwarding SIGINT/SIGTERM to the jobs running in other processes, and the multirun's exit status.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import cast

from omegaconf import OmegaConf

from ..command import continue_command
from ..errors import CsfError, ExitCode, UnsafePathError, printable
from ..files import SafeDir
from ..signals import exit_status, signal_name
from .job import JOBS, PARENT_ENV, dead_jobs, describe, exit_status_of, handling_stop_signals, run_sweep_job
from .leftovers import GRACE_SECONDS, end_sweep_processes
from .marks import INTERRUPTED, REFUSED, SAID, mark_interrupted, refused_jobs, reset_stop
from .plot import PLOT, PLOT_SVG, swept_keys
from ..multirun import SweepEnded
from .table import (LOCK, TABLE_CSV, TABLE_JSON, job_files, load_rows, locked, make_row, read_rows, rebuild_rows,
                    record_row, row_overrides, write_table)

__all__ = ["start", "SweepEnded", "finish", "forward_signals", "run_sweep_job", "record_row",
           "read_rows", "started", "write_table"]

_SWEEP_DIR: Path | None = None  # the sweep directory of the multirun this process is the parent of
_OBJECTIVE = "val/loss"
_MAXIMIZE = False  # sweep.direction
_STARTED = 0.0  # time.time() when the multirun started: a job whose summary is older was not run again
_NUMBERED = True  # the job directories are <sweep dir>/<job number> (Hydra's default hydra.sweep.subdir)
JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
#: What Hydra writes in the sweep directory itself (with ``OmegaConf.save``: following links, truncating).
MULTIRUN_YAML, OPTUNA_RESULTS = "multirun.yaml", "optimization_results.yaml"
#: Files csframework or Hydra write in the sweep directory: a directory in their place is refused.
_FILES = (MULTIRUN_YAML, OPTUNA_RESULTS, TABLE_JSON, TABLE_CSV, PLOT, PLOT_SVG, LOCK, INTERRUPTED, REFUSED, SAID)


def start(config) -> None:
    """The multirun's parent starts (the Hydra callback, ``csframework.sweep_callback``): a fresh start (no
    mark of an earlier run's interruption or refused jobs) in a sweep directory checked first; what is wrong
    there is one line and exit 2, before any job starts."""
    global _SWEEP_DIR, _OBJECTIVE, _MAXIMIZE, _STARTED, _NUMBERED
    _SWEEP_DIR, _STARTED = Path(config.hydra.sweep.dir), time.time()
    _OBJECTIVE = str(config.get("sweep", {}).get("objective", "val/loss"))
    _MAXIMIZE = str(config.get("sweep", {}).get("direction", "minimize")) == "maximize"
    reset_stop()
    guard_launcher(str(config.hydra.get("launcher", {}).get("_target_", "")))
    try:
        subdir = cast(dict, OmegaConf.to_container(config.hydra.sweep, resolve=False)).get("subdir") \
            if "sweep" in config.get("hydra", {}) else None
        _NUMBERED = subdir == "${hydra.job.num}"
        prepare(_SWEEP_DIR, OmegaConf.to_yaml(config), numbered=_NUMBERED)
    except (UnsafePathError, OSError) as e:
        if config.get("debug", False):
            raise
        sys.stderr.write(f"csframework: {printable(' '.join(str(e).split()))}\n")
        sys.exit(ExitCode.CONFIG_ERROR)


def guard_launcher(target: str) -> None:
    """Under hydra-joblib-launcher (``target``: the launcher's ``_target_``): when a worker process dies
    mid-sweep (SIGKILL, the OOM killer, a crash in native code), loky kills every other worker and joblib
    raises ``TerminatedWorkerError`` from the launcher. Its ``launch`` is wrapped once so that this ends the
    multirun cleanly (``worker_died``) instead of in a traceback with no job named and no row."""
    if target != JOBLIB_LAUNCHER:
        return
    import importlib

    module, _, name = JOBLIB_LAUNCHER.rpartition(".")
    launcher = getattr(importlib.import_module(module), name)  # the one Hydra instantiates (target)
    original = launcher.launch
    if getattr(original, "_csframework_guarded", False):
        return

    @functools.wraps(original)
    def launch(self, job_overrides, initial_job_idx):
        try:
            return original(self, job_overrides, initial_job_idx)
        except BrokenProcessPool as e:  # loky's TerminatedWorkerError is one
            if _SWEEP_DIR is None:
                raise
            worker_died(_SWEEP_DIR, [list(o) for o in job_overrides], initial_job_idx, e)
            raise SweepEnded(1) from None

    launch._csframework_guarded = True  # type: ignore[attr-defined]
    launcher.launch = launch


def worker_died(sweep_dir: Path, jobs: list[list[str]], first: int, error: BaseException) -> None:
    """A worker process of the launcher died running the batch ``jobs`` (job numbers from ``first``): one
    line names the job(s) whose process was gone (the one that died, and any loky ended with it: they cannot
    be told apart), and every job of the batch without a row gets one: those ``failed``, the ones never
    started ``interrupted``, each with its ``error``. A rerun with ``checkpoint.resume=auto`` runs them again
    (from their checkpoints, if they wrote any); the jobs that completed keep their rows."""
    codes = re.search(r"exit codes of the workers are (\{[^}]*\})", str(error))
    how = f"exit codes {codes.group(1)}" if codes else printable(" ".join(str(error).split())[:200])
    died = dead_jobs(sweep_dir)
    names = {first + i: describe(first + i, overrides) for i, overrides in enumerate(jobs)}
    ran = " or ".join(names.get(num, f"job {num}") for num in sorted(died)) or "a job"
    with locked(sweep_dir):
        done = {r["job"] for r in read_rows(sweep_dir)}
    left = [first + i for i in range(len(jobs)) if first + i not in done and first + i not in died]
    sys.stderr.write(f"csframework: a joblib worker process died ({how}) running {ran}; joblib ended its other "
                     f"workers with it, so the sweep ends here ({len(left)} jobs not run); rerun with "
                     "checkpoint.resume=auto to run them again\n")
    died_why = f"its worker process died ({how})" + (", or joblib ended it when another worker died"
                                                     if len(died) > 1 else "")
    for i, overrides in enumerate(jobs):
        num = first + i
        if num in done:
            continue
        status, why = ("failed", died_why) if num in died else ("interrupted", f"not run: a worker process died ({how})")
        row = make_row(num, overrides, status, None, None, sweep_dir / str(num) if _NUMBERED else None)
        row["error"] = why
        with contextlib.suppress(OSError, CsfError):
            record_row(sweep_dir, row)


def prepare(sweep_dir: Path, multirun_yaml: str, numbered: bool = True) -> None:
    """Make the sweep directory ready: ``multirun.yaml`` written as a fresh file (Hydra's ``OmegaConf.save``
    then rewrites that file, not what a planted link or hard link names), no link or hard link where Hydra
    writes ``optimization_results.yaml``, the marks of an earlier multirun and the stale entries of
    ``.jobs`` removed, the lock usable, and a damaged table rebuilt from the job directories. With job
    directories named by number (``numbered``, Hydra's default ``hydra.sweep.subdir``), a file, FIFO or
    link to no directory at such a name is refused now (Hydra's launcher would fail on it with a
    traceback); a link to a directory fails its job alone (``job.job_dir``)."""
    sweep = SafeDir(sweep_dir).sub()  # made if absent; a link or a file there is refused
    for name in sweep.names() if numbered else []:
        if name.isdigit() and sweep.kind(name) != "dir" and not (
                sweep.kind(name) == "link" and os.path.isdir(sweep / name)):
            raise UnsafePathError(f"{sweep / name}: it is where job {int(name)} of this sweep runs, and it is not a "
                                  "directory; remove it or choose another hydra.sweep.dir")
    for name in _FILES:
        if sweep.kind(name) == "dir":
            raise UnsafePathError(f"{sweep / name}: it is a directory, where the sweep writes a file; remove it "
                                  "or choose another hydra.sweep.dir")
    jobs = sweep.sub(JOBS)  # a link or a file there is refused
    with locked(sweep_dir):  # a link, hard link or FIFO as the lock is refused
        pass
    try:
        sweep.write(MULTIRUN_YAML, multirun_yaml)
    except OSError as e:
        raise UnsafePathError(f"{sweep / MULTIRUN_YAML}: cannot write it ({e.strerror or e})") from e
    if sweep.kind(OPTUNA_RESULTS) in ("link", "other") or (
            sweep.kind(OPTUNA_RESULTS) == "file" and _names(sweep, OPTUNA_RESULTS) > 1):
        sweep.remove(OPTUNA_RESULTS)  # the entry only: what a link or other name points at stays as it is
    for mark in (INTERRUPTED, REFUSED, SAID):
        sweep.remove(mark)
    for stale in jobs.names():  # left by a job killed outright in an earlier run (files named by a pid)
        if stale.isdigit() and jobs.kind(stale) in ("file", "link"):
            jobs.remove(stale)
    with locked(sweep_dir):
        rows, problem = load_rows(sweep_dir)
        if problem is not None or sweep.kind(TABLE_CSV) not in (None, "file"):
            if problem is not None:
                rows = rebuild_rows(sweep_dir)
                sys.stderr.write(f"csframework: {printable(str(sweep / TABLE_JSON))}: {printable(problem)}; the "
                                 f"table is rebuilt from the job directories ({len(rows)} rows)\n")
            write_table(sweep_dir, rows)


def _names(sweep: SafeDir, name: str) -> int:
    with sweep.opened(create=False) as fd:
        return os.stat(name, dir_fd=fd, follow_symlinks=False).st_nlink


def _job_pids(sweep_dir: Path) -> list[int]:
    """The processes running a job of this multirun now. Where /proc tells, a pid counts only if that
    process was started under this multirun (a stale entry's pid may belong to another process now)."""
    mine = f"{PARENT_ENV}={os.getpid()}".encode()
    pids = []
    try:
        entries = SafeDir(sweep_dir, JOBS).names()
    except (OSError, CsfError):  # no longer a real directory: nothing to forward to
        return []
    for name in entries:
        if name.isdigit() and name != str(os.getpid()):
            try:
                environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            except FileNotFoundError:
                if Path("/proc/self").exists():
                    continue  # no such process any more
                environ = [mine]  # no /proc here: trust the entry
            except OSError:
                continue
            if mine in environ:
                pids.append(int(name))
    return pids


@contextlib.contextmanager
def forward_signals():
    """In the multirun's parent: a SIGINT/SIGTERM marks the sweep interrupted (jobs not started yet will not
    start) and is passed on to every job running in another process (each finishes its step, checkpoints
    and ends as ``interrupted``); a second one is passed on too and exits at once."""
    os.environ[PARENT_ENV] = str(os.getpid())
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)
        if _SWEEP_DIR is not None:
            mark_interrupted(_SWEEP_DIR, signum)
            for pid in _job_pids(_SWEEP_DIR):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)
        with contextlib.suppress(OSError):
            if len(received) == 1:
                os.write(2, f"\ncsframework: {signal_name(signum)}: stopping the sweep; running jobs finish "
                            "their step and save a checkpoint (send it again to exit at once)\n".encode())
            else:
                os.write(2, f"csframework: {signal_name(signum)} again: exiting now\n".encode())
        if len(received) > 1:
            os._exit(exit_status(signum))

    try:
        with handling_stop_signals(handler):
            yield
    finally:
        os.environ.pop(PARENT_ENV, None)


_FORWARDING = contextlib.ExitStack()  # the signal forwarding of the multirun running now, closed by finish


def start_forwarding() -> None:
    """``forward_signals`` from the multirun's start (``check.start_checked``) until ``finish``."""
    _FORWARDING.enter_context(forward_signals())


def _stop_idle_workers() -> None:
    """Every job has ended: stop joblib's loky workers now (else the interpreter's exit waits several
    seconds for them) and leave Ray (a cluster started on the fly stops; its workers' last log lines are
    printed before the multirun's own last lines)."""
    loky = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(loky, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=True, kill_workers=True)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def started() -> bool:
    """Whether this process started a multirun (``SweepCallback``): the CLI then ends with ``finish``."""
    return _SWEEP_DIR is not None


def finish() -> ExitCode:
    """After the multirun: the signals no longer forwarded (``start_forwarding``), no process of the sweep's
    left (``leftovers``), ``sweep.png`` (unless interrupted); on stderr the sweep's end (``end_line``), then
    the jobs that failed or were stopped; returns the multirun's exit status."""
    from .plot import write_sweep_plot

    _FORWARDING.close()
    _stop_idle_workers()
    if _SWEEP_DIR is None:
        return ExitCode.OK
    killed = end_sweep_processes(os.getpid())  # every job has ended: so does every process of the sweep's
    if killed:
        sys.stderr.write(f"csframework: ended {len(killed)} process(es) of the sweep still running "
                         f"{GRACE_SECONDS:g} s after its last job: {printable(', '.join(killed))}\n")
    with contextlib.suppress(OSError, CsfError), SafeDir(_SWEEP_DIR).opened(create=False) as fd:
        os.rmdir(JOBS, dir_fd=fd)  # empty now (every job has ended); a link or a file there is not removed
    rows = read_rows(_SWEEP_DIR)
    status = exit_status_of(_SWEEP_DIR, rows)
    plot = None
    # no plot when interrupted: leave promptly; the table is there, a rerun draws the plot
    if rows and status in (ExitCode.OK, ExitCode.FAILED):
        with contextlib.suppress(OSError, CsfError):  # a plot the directory refuses costs the plot only
            plot = write_sweep_plot(_SWEEP_DIR, rows, _OBJECTIVE)
    failed = [r for r in rows if r.get("status") == "failed"]
    stopped = [r for r in rows if r.get("status") == "interrupted"]
    table = printable(str(_SWEEP_DIR / TABLE_CSV))
    lines = [end_line(_SWEEP_DIR, rows, plot)]  # then the jobs that failed or were stopped, if any
    if failed:
        lines.append(f"csframework: {len(failed)} of {len(rows)} jobs failed (table: {table}):")
    lines += [_line(row) for row in failed]
    if status >= 128:
        lines.append(f"csframework: sweep interrupted by {signal_name(status - 128)}"
                     + (f"; the jobs it stopped (table: {table}):" if stopped else "; no job was running"))
        lines += [_line(row) for row in stopped]
        lines.append(f"csframework: continue the sweep with: {printable(continue_command(_SWEEP_DIR, sweep=True))}")
    sys.stderr.write("".join(line + "\n" for line in lines))
    return status


def end_line(sweep_dir: Path, rows: list[dict], plot: Path | None) -> str:
    """The sweep's closing line: its jobs (completed, failed, skipped: completed before and not run again,
    and interrupted or refused if any), the best job by ``sweep.objective`` and ``sweep.direction`` with its swept
    overrides, and where the table and the plot are."""
    refused = refused_jobs(sweep_dir)  # their rows are the runs in their directories, which they left alone
    ran = [row for row in rows if row.get("job") not in refused]
    skipped = sum(1 for row in ran if row.get("status") == "completed" and _older_than_sweep(sweep_dir, row))
    count = {s: sum(1 for row in ran if row.get("status") == s) for s in ("completed", "failed", "interrupted")}
    jobs = (f"{len(rows)} job{'s' if len(rows) != 1 else ''} ({count['completed'] - skipped} completed, "
            f"{count['failed']} failed, {skipped} skipped"
            + (f", {count['interrupted']} interrupted" if count["interrupted"] else "")
            + (f", {len(refused)} refused" if refused else "") + ")")
    done = [(value, row) for row in rows if row.get("status") == "completed"
            and isinstance(value := row.get(_OBJECTIVE), (int, float)) and math.isfinite(value)]
    best = "no job reported " + _OBJECTIVE
    if done:
        value, row = (max if _MAXIMIZE else min)(done, key=lambda found: found[0])
        swept = swept_keys(rows)  # the settings that tell the jobs apart (all, for a sweep of one job)
        overrides = " ".join(f"{k}={v}" for k, v in row_overrides(row).items() if k in swept or not swept)
        best = f"best job {row['job']} ({overrides}): {_OBJECTIVE}={value:.6g}"
    where = f"table: {sweep_dir / TABLE_CSV}" + (f", plot: {plot}" if plot is not None else "")
    return printable(f"csframework: sweep ended: {jobs}; {best}; {where}")


def _older_than_sweep(sweep_dir: Path, row: dict) -> bool:
    """Whether the row's job's ``summary.json`` predates this multirun (the job completed before and was not
    run again); a run directory outside the sweep directory, or no such file, is not."""
    try:
        files = job_files(sweep_dir, row)
        if files is None:
            return False
        with files.opened(create=False) as fd:
            return os.stat("summary.json", dir_fd=fd, follow_symlinks=False).st_mtime < _STARTED
    except (OSError, CsfError):
        return False


def _line(row: dict) -> str:
    overrides = [f"{k}={v}" for k, v in row_overrides(row).items()]
    return f"  - {describe(row['job'], overrides)}: {printable(str(row.get('run_dir')))}"
