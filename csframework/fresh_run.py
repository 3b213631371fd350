"""One run per run directory: a fresh run never starts over a run directory that holds a run, nor does a
checkpoint of another run resume there (``check_fresh_start``, which every way into a run passes through:
``Run.fit`` and ``Run.validate`` from Python, the CLI, ``checkpoint.resume=<path>``, a sweep's jobs), unless
asked with ``checkpoint.start_over=true`` (the old run's files are moved aside first, all or nothing:
``previous_runs.move_aside``).
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

from .builtin.checkpoint.format import read_meta
from .builtin.checkpoint.store import checkpoint_names, resume_source, scan_checkpoints
from .command import continue_run
from .errors import DamagedCheckpoint, RunDirHoldsRun, UnsafePathError, printable
from .files import SafeDir
from .previous_runs import PREVIOUS_RUNS, move_aside
from .rundir import LOCK_NAME, run_records, writer_lock

_SUMMARY_BYTES = 1 << 20  # what an earlier run's summary.json may take for its run id to be read


@contextlib.contextmanager
def writing(run, first: bool) -> Iterator[None]:
    """What ``Run.fit`` and ``Run.validate`` (every way into a run) hold while they run: the run directory's
    lock (``rundir.writer_lock``) and, ``first`` (the ``Run``'s first of them), the fresh-run rule
    (``check_fresh_start``), before anything is written."""
    with writer_lock(run.output_dir, run.rank):
        if first and run.rank == 0:
            check_fresh_start(run)
        yield


def check_fresh_start(run) -> None:
    """The fresh-run rule, checked once per ``Run`` when its first ``fit`` or ``validate`` starts (rank 0, the
    run directory's lock held, before anything is written): in a directory that holds a run
    (``run_records``), only ``checkpoint.resume=auto`` or a checkpoint of that run (``other_lineage``) goes on.
    Anything else, a fresh run or a checkpoint of another run, is refused (``RunDirHoldsRun``, exit 2, naming
    the directory and the ways on), or with ``checkpoint.start_over=true`` the old run's files are moved into
    ``previous-runs/<time>/`` first, all or nothing."""
    files, resume = run.files, str(run.config.checkpoint.resume)
    found = run_records(files)
    if not found:
        return
    if resume == "auto":
        if files.kind("checkpoints") is not None or not trained_unresumable(files):
            return  # resumed from its checkpoints (or refused by them), or started over a failed run
        if run.config.checkpoint.start_over:
            _move_aside(run, files)
            return
        raise RunDirHoldsRun(
            f"checkpoint.resume=auto: run directory {printable(str(files.path))} holds a run that trained "
            f"({', '.join(found)}) but has no checkpoint to continue it from, and a new run there would mix its "
            "records with that run's; start a new run in another directory (hydra.run.dir=...), or here with "
            f"checkpoint.start_over=true (the old run's files are moved into {PREVIOUS_RUNS}/ there)")
    other = None if resume == "never" else other_lineage(Path(resume), files)
    if resume != "never" and other is None:  # a checkpoint of the run there: it goes on
        return
    if run.config.checkpoint.start_over:
        _move_aside(run, files)
        return
    shown, ways = printable(str(files.path)), (
        f"or here with checkpoint.start_over=true (the old run's files are moved into {PREVIOUS_RUNS}/ there)")
    if other is not None:
        raise RunDirHoldsRun(printable(
            f"checkpoint.resume={resume}: {other}, not of the run that run directory {shown} holds "
            f"({', '.join(found)}); resume it into a new run directory (hydra.run.dir=...), {ways}; or continue "
            f"the run there with: {continue_run(files.path)}"))
    raise RunDirHoldsRun(
        f"run directory {shown} holds a run ({', '.join(found)}); continue it with: "
        f"{printable(continue_run(files.path))}, or start a new run in another directory (hydra.run.dir=...), "
        + ways)


def _move_aside(run, files: SafeDir) -> None:
    moved = move_aside(files, keep=(LOCK_NAME,))
    run.log.warning("previous_run_moved", path=str(moved),
                    problem=f"{files.path} held a run; its files are now in {moved} (checkpoint.start_over=true)")


def trained_unresumable(files: SafeDir) -> bool:
    """Whether the run a directory holds trained and did not fail, as its records say (read as untrusted data):
    its summary.json says so (a ``global_step`` above 0, a status other than ``failed``), or, without one, its
    metrics.csv has a row beyond the header. A run that failed (its checkpoints, if it had any, are what
    ``resume=auto`` continues) or took no step is started again there by ``resume=auto``, as before."""
    try:
        summary = json.loads(files.read("summary.json", _SUMMARY_BYTES))
        status, step = summary.get("status"), summary.get("global_step")
    except FileNotFoundError:
        status = step = None
    except (OSError, ValueError, AttributeError, RecursionError, UnsafePathError):
        return True  # a record that cannot be read is not a failure's to start over
    if status is not None or step is not None:
        return status != "failed" and type(step) is int and step > 0
    try:
        with files.reader("metrics.csv") as f:
            head = f.read(1 << 16)  # the header and a row, if there is one
    except (OSError, ValueError, UnsafePathError):
        return False
    return any(row.strip() for row in head.splitlines()[1:])


def other_lineage(target: Path, files: SafeDir) -> str | None:
    """Why the checkpoints ``checkpoint.resume=<target>`` may load are not of the run that the run directory
    ``files`` holds (one phrase), or None when they are: each is one of that directory's own checkpoints (in
    its ``checkpoints/``, as ``resume=auto`` would choose), or its run id (its meta.json) is one that
    directory's own records carry (the meta.json of its checkpoints, its summary.json): a copy of one of
    them elsewhere. Lying below the run directory decides nothing: a checkpoint under ``previous-runs/``
    there is an earlier run's."""
    source, choose = resume_source(target)
    own = files / "checkpoints"
    candidates = [source / name for name in checkpoint_names(source)[0]] if choose else [source]
    if not candidates and os.path.realpath(source) != os.path.realpath(own):
        return f"{source} holds no complete checkpoint"
    elsewhere = [c for c in candidates if os.path.realpath(c.parent) != os.path.realpath(own)]
    if not elsewhere:  # its own (a damaged one is named by the resume itself)
        return None
    ours = {_run_id_of(own / name) for name in scan_checkpoints(own)} | {_summary_run_id(files)}
    for checkpoint in elsewhere:
        run_id = _run_id_of(checkpoint)
        if run_id is None:
            return f"checkpoint {checkpoint} records no run id (an older or damaged checkpoint)"
        if run_id not in ours:
            return f"checkpoint {checkpoint} is of run {run_id}"
    return None


def _run_id_of(checkpoint: Path) -> str | None:
    """The run id a checkpoint's meta.json records (read as untrusted data), or None."""
    try:
        run_id = read_meta(checkpoint).get("run_id")
    except DamagedCheckpoint:
        return None
    return run_id[:64] if isinstance(run_id, str) and run_id else None


def _summary_run_id(files: SafeDir) -> str | None:
    """The run id of the run directory's summary.json (read as untrusted data), or None."""
    try:
        run_id = json.loads(files.read("summary.json", _SUMMARY_BYTES)).get("run_id")
    except (OSError, ValueError, AttributeError, RecursionError, UnsafePathError):
        return None
    return run_id[:64] if isinstance(run_id, str) and run_id else None
