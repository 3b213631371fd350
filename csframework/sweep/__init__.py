"""Multirun sweeps that survive failing jobs, interrupts and reruns (see docs/sweeps.md).

- :mod:`.job`: one job as any launcher runs it (failure isolation, signals, skip when completed, its row);
- :mod:`.table`: the live ``sweep.csv`` / ``sweep.json``;
- :mod:`.plot`: ``sweep.png``;
- here: what the multirun's parent process does: the Hydra callback (registered in ``conf/config.yaml``),
  forwarding SIGINT/SIGTERM to the jobs running in other processes, and the multirun's exit status.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from ..signals import exit_status, signal_name
from .job import (INTERRUPTED, JOBS, PARENT_ENV, REFUSED, describe, exit_status_of, handling_stop_signals,
                  mark_interrupted, run_sweep_job)
from .table import TABLE_CSV, read_rows, record_row, row_overrides, write_table

__all__ = ["SweepCallback", "finish", "forward_signals", "run_sweep_job", "record_row",
           "read_rows", "write_table"]

_SWEEP_DIR: Path | None = None  # the sweep directory of the multirun this process is the parent of
_OBJECTIVE = "val/loss"


class SweepCallback(Callback):
    """The multirun's parent: a fresh start (no mark of an earlier run's interruption or refused jobs)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        global _SWEEP_DIR, _OBJECTIVE
        _SWEEP_DIR = Path(config.hydra.sweep.dir)
        _OBJECTIVE = str(config.get("sweep", {}).get("objective", "val/loss"))
        _SWEEP_DIR.mkdir(parents=True, exist_ok=True)
        for mark in (INTERRUPTED, REFUSED):
            (_SWEEP_DIR / mark).unlink(missing_ok=True)
        for stale in (_SWEEP_DIR / JOBS).glob("*"):  # left by a job killed outright in an earlier run
            stale.unlink(missing_ok=True)


def _job_pids(sweep_dir: Path) -> list[int]:
    """The processes running a job of this multirun now. Where /proc tells, a pid counts only if that
    process was started under this multirun (a stale entry's pid may belong to another process now)."""
    mine = f"{PARENT_ENV}={os.getpid()}".encode()
    pids = []
    with contextlib.suppress(FileNotFoundError):
        for entry in (sweep_dir / JOBS).iterdir():
            if entry.name.isdigit() and entry.name != str(os.getpid()):
                try:
                    environ = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
                except FileNotFoundError:
                    if Path("/proc/self").exists():
                        continue  # no such process any more
                    environ = [mine]  # no /proc here: trust the entry
                except OSError:
                    continue
                if mine in environ:
                    pids.append(int(entry.name))
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


def finish() -> int:
    """After the multirun: ``sweep.png`` (unless interrupted); the last lines on stderr name the jobs that
    failed; returns the multirun's exit status."""
    from .plot import write_sweep_plot

    _stop_idle_workers()
    if _SWEEP_DIR is None:
        return 0
    with contextlib.suppress(OSError):  # empty now: every job has ended
        (_SWEEP_DIR / JOBS).rmdir()
    rows = read_rows(_SWEEP_DIR)
    status = exit_status_of(_SWEEP_DIR, rows)
    if rows and status < 128:  # interrupted: leave promptly; the table is there, a rerun draws the plot
        write_sweep_plot(_SWEEP_DIR, rows, _OBJECTIVE)
    failed = [r for r in rows if r.get("status") == "failed"]
    lines = []
    if failed:
        lines.append(f"csframework: {len(failed)} of {len(rows)} jobs failed (table: {_SWEEP_DIR / TABLE_CSV}):")
    for row in failed:
        overrides = [f"{k}={v}" for k, v in row_overrides(row).items()]
        lines.append(f"  - {describe(row['job'], overrides)}: {row['run_dir']}")
    if status >= 128:
        lines.append("csframework: sweep interrupted; run the same command with checkpoint.resume=auto to "
                     "continue it")
    sys.stderr.write("".join(line + "\n" for line in lines))
    return status


def sweeper_overrides(argv: list[str]) -> list[str]:
    """The command line, with Optuna's direction following ``sweep.direction`` unless it is given."""
    if any(a.startswith("hydra/sweeper=optuna") for a in argv) and not any(
            a.startswith("hydra.sweeper.direction=") for a in argv):
        return [*argv, "hydra.sweeper.direction=${sweep.direction}"]
    return argv
