"""The metrics plugin: the model summary at the start of a fit, every reported metric as a row of
``metrics.csv`` (``step,stage,name,value``), and, when the run ends, fails or stops, ``summary.json``
(status, global step, device type, final metrics, the model, ``wall_seconds``, ``eval_seconds``,
``compile_seconds``, ``steps_per_sec`` of training alone, peak memory, the command line) and the curves
(``curves.png`` or ``curves.svg``). A fit resumed from a checkpoint first moves the rows of steps after it
(a killed run's, about to be logged again) into ``metrics-superseded.csv`` (``supersede_rows_after``)."""
from __future__ import annotations

import csv
import io
import json
import os
import sys
import time
from itertools import repeat
from typing import Any, Iterator, cast

from ..command import command_line
from ..config.sections import test_metrics
from ..errors import ExitCode, UnsafePathError
from ..failures import error_record
from ..files import SafeDir
from ..hookspecs import hookimpl
from ..jsonout import dumps
from ..summary_file import read_summary
from .logs import WRITE_INTERVAL
from .plot import write_curves


def model_summary(model) -> dict:
    """Parameter counts (shared parameters once) and the size in MB (10^6 bytes) of parameters and buffers."""
    params = list(model.parameters())
    size = sum(t.numel() * t.element_size() for t in [*params, *model.buffers()])
    return {"parameters": sum(p.numel() for p in params),
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "size_mb": round(size / 1e6, 3)}


def peak_memory(device_type: str) -> dict:
    """This process's peak resident memory, and on a GPU the most CUDA memory torch allocated, in MB."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak = {"rss_mb": round(rss * (1 if sys.platform == "darwin" else 1024) / 1e6, 1)}
    if device_type == "GPU":
        import torch

        peak["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 1e6, 1)
    return peak


class MetricsPlugin:
    name = "metrics"

    def __init__(self):
        self.file = None
        self.writer = None
        self.rows: list[tuple] = []  # held until WRITE_INTERVAL after the last write (or the run's end)
        self.written = 0.0  # time.monotonic() of the last write
        self.model = None
        self.started: tuple[float, ...] | None = None  # at on_fit_start: perf_counter and the run's timings
        self.resumed_at: int | None = None  # the step of the checkpoint a fit resumed from

    @hookimpl
    def on_checkpoint_load(self, run, state):
        """(The checkpoint plugin loads it in its ``on_fit_start``, which runs before ours.)"""
        if run.mode == "fit":
            self.resumed_at = run.global_step

    @hookimpl
    def on_fit_start(self, run):
        resumed_at, self.resumed_at = self.resumed_at, None  # this fit's (a validate after it loads none)
        if run.rank == 0:  # the files first: one refused (a link, say) leaves the earlier summary.json (_finish)
            if resumed_at is not None and run.mode == "fit":
                moved = supersede_rows_after(run.files, resumed_at)
                if moved:
                    run.log.info("metrics_rows_superseded", rows=moved, after_step=resumed_at,
                                 file=str(run.files / SUPERSEDED))
            self.file = run.files.append("metrics.csv")  # a regular file of the run directory, never a link
            new = os.fstat(self.file.fileno()).st_size == 0
            self.writer = csv.writer(self.file)
            if new:
                self.writer.writerow(["step", "stage", "name", "value"])
        self.started = (time.perf_counter(), *_timings(run))
        self.model = model_summary(run.model)
        run.log.info("model", **self.model)

    @hookimpl
    def on_log_metrics(self, run, metrics, step):
        if self.writer is not None:  # the rows (step, stage, name, value) zipped in C: no Python code a row
            self.rows.extend(zip(repeat(step), repeat(run.stage), metrics.keys(), metrics.values()))
            if time.monotonic() - self.written >= WRITE_INTERVAL:  # as events.jsonl's lines (logs.py)
                self._write_rows()

    def _write_rows(self) -> None:
        """The rows held so far, written and flushed to the OS."""
        self.writer.writerows(self.rows)
        self.file.flush()
        self.rows.clear()
        self.written = time.monotonic()

    @hookimpl
    def on_checkpoint_save(self, run, state):
        """The rows held (``WRITE_INTERVAL``) are written before the checkpoint is: they are of steps it holds,
        which a run killed after it and resumed from it does not take, nor log, again."""
        if self.writer is not None and self.rows:
            self._write_rows()

    @hookimpl
    def on_fit_end(self, run):
        self._finish(run)

    @hookimpl
    def on_exception(self, run, error):
        self._finish(run, error)

    def _finish(self, run, error=None):
        if self.file is not None:
            self._write_rows()
            self.file.close()
            self.file = self.writer = None
        if run.rank != 0:
            return
        if error is not None and self.started is None and getattr(error, "exit_code", None) == ExitCode.CONFIG_ERROR:
            return  # refused before it began (nothing trained): an earlier run's summary.json stays
        if error is None and run.already_complete and (kept := self._completed_before(run)) is not None:
            if type(kept["metrics"].get("steps_per_sec")) is float and "steps_per_sec" in run.metrics:
                run.metrics["steps_per_sec"] = kept["metrics"]["steps_per_sec"]  # the fit's, as that summary says
            for name, value in kept["metrics"].items():  # its test sets' metrics: the fit returns them too
                run.metrics.setdefault(name, value)
            return  # resumed at its end, nothing done: the summary of the run that got there stays
        figures = self._figures(run)
        if figures.get("steps_per_sec") is not None and "steps_per_sec" in run.metrics:
            # one figure: the fit's training rate, also what the fit_end line and summary.json's metrics say;
            # a run resumed at its end trained nothing here: its rate is the one its checkpoint holds
            if run.already_complete:
                figures["steps_per_sec"] = run.metrics["steps_per_sec"]
            else:
                run.metrics["steps_per_sec"] = figures["steps_per_sec"]
        summary = run.summary()
        summary.update(figures)
        if error is not None:
            summary["error"] = error_record(run, error)  # one line, as the console's
        name = self._summary_name(run)
        run.files.write(name, dumps(summary, indent=2, where=name))
        if run.mode == "fit":  # curves are training's; an evaluation alone has none to draw
            write_curves(run.files, title=curves_title(run, summary["status"]))

    @staticmethod
    def _summary_name(run) -> str:
        """``summary.json``; for ``mode=validate``, ``test`` or ``predict`` in the directory of a run that trained
        (its ``summary.json`` a fit's), ``summary-<mode>.json``, so that the training's summary stays."""
        if run.mode != "fit":
            kept, _ = read_summary(run.files)
            if kept is not None and kept.get("mode", "fit") == "fit":
                return f"summary-{run.mode}.json"
        return "summary.json"

    @staticmethod
    def _completed_before(run) -> dict | None:
        """The run directory's ``summary.json`` (read as untrusted) when it says completed at this step, with the
        metrics the checkpoint resumed holds (derived, not believed: an edited summary is rewritten);
        not its ``steps_per_sec``, the fit's rate where the checkpoint holds the last log's."""
        summary, _ = read_summary(run.files)
        ours = json.loads(dumps({k: v for k, v in run.metrics.items() if k != "steps_per_sec"}))
        if summary is None or summary["status"] != "completed" or summary["global_step"] != run.global_step:
            return None
        theirs = {k: v for k, v in summary["metrics"].items() if k != "steps_per_sec"}
        # every metric the checkpoint holds must be there, the same; besides them only the test sets' (data.test:
        # measured after the last checkpoint, which cannot hold them)
        tested = test_metrics(theirs, run.stage_config.data)
        same = {k: theirs.get(k) for k in ours} == ours and all(k in tested for k in theirs if k not in ours)
        return summary if same else None

    def _figures(self, run) -> dict:
        """What summary.json adds to ``run.summary()``. On CSX ``model.compile`` holds the compile report's
        op count and memory estimates. ``best_checkpoint`` comes with ``run.summary()`` when the checkpoint
        plugin keeps one (``checkpoint.keep_best``)."""
        model = dict(self.model or model_summary(run.model))
        compiled = getattr(run.backend, "compile_figures", lambda: None)()
        if compiled:
            model["compile"] = compiled
        out: dict[str, Any] = {"model": model, "peak_memory": peak_memory(run.device_type),
                               "command_line": command_line()}
        if self.started is not None:
            evals, compiles, seconds, steps = (now - then for now, then in zip(_timings(run), self.started[1:]))
            out.update(wall_seconds=round(time.perf_counter() - self.started[0], 3), eval_seconds=round(evals, 3),
                       compile_seconds=round(compiles, 3), train_seconds=round(seconds, 3),
                       steps_per_sec=round(steps / seconds, 3) if seconds > 0 else None)
        return out


#: Where a resumed fit moves the rows of ``metrics.csv`` of steps after its checkpoint
SUPERSEDED = "metrics-superseded.csv"
#: A line of ``metrics.csv`` read in pieces of at most this many bytes (the file is untrusted: no line is read whole)
_PIECE = 1 << 16


def supersede_rows_after(files: SafeDir, step: int) -> int:
    """Move the rows of the run directory's ``metrics.csv`` whose step is after ``step`` to the end of
    ``metrics-superseded.csv`` (created with the header), and return how many moved. They were logged by a
    run killed (or resumed from an earlier checkpoint) after the checkpoint of ``step``; the resumed fit logs
    those steps again, so without this ``metrics.csv`` would hold two rows, and the curves two points, for
    each. The file is untrusted: a line that is no row of a step (the header, an overlong line, damage)
    stays where it is (a last line left unended is ended by the next append, ``SafeDir.append``). The moved
    rows are appended and made durable before ``metrics.csv`` is replaced (atomically), so a crash in
    between loses nothing (at worst the rows are in both files). A ``metrics.csv`` that is absent or not a
    regular file is left alone (``files.append`` refuses the latter with its own message). Two reads: one to
    see whether any row moves, one to move them."""
    def lines() -> Iterator[tuple[bool, bytes]]:  # (after step, the line's bytes), in pieces for overlong lines
        try:
            f = files.reader("metrics.csv")
        except (OSError, ValueError, UnsafePathError):
            return
        with f:
            ended = True  # whether the piece before ended its line
            while piece := f.readline(_PIECE):
                whole = ended and (piece.endswith(b"\n") or len(piece) < _PIECE)
                head = piece.split(b",", 1)[0]
                ended = piece.endswith(b"\n")
                yield whole and head.isdigit() and len(head) < 20 and int(head) > step, piece

    if not any(later for later, _ in lines()):
        return 0
    moved = 0
    with files.atomic("metrics.csv") as kept, files.append(SUPERSEDED) as text:
        out = cast(io.TextIOWrapper, text).buffer  # the rows' bytes as they were
        if os.fstat(out.fileno()).st_size == 0:
            out.write(b"step,stage,name,value\r\n")
        for later, line in lines():
            if later:
                out.write(line if line.endswith(b"\n") else line + b"\r\n")
                moved += 1
            else:
                kept.write(line)
        out.flush()
        os.fsync(out.fileno())  # before metrics.csv is replaced, as the atomic block ends
    return moved


def curves_title(run, status: str) -> str:
    """``curves.png``'s title: the run's name (the last two parts of its directory: a date and a time, or a
    sweep and a job), its status and id; then the settings that differ from the defaults (the overrides Hydra
    composed it with, when it did: the command line's, a sweep job's), or ``default settings``."""
    where = run.output_dir.resolve()
    name = f"{where.parent.name}/{where.name}" if where.parent.name else where.name
    overrides = composed_overrides()
    settings = " ".join(overrides) if overrides else "default settings" if overrides is not None else ""
    return f"{name} ({status}, run {run.run_id})" + (f"\n{settings}" if settings else "")


def composed_overrides() -> list[str] | None:
    """The overrides of the run Hydra is running (Hydra's own, ``hydra.*`` and ``hydra/*``, left out), or ``None`` outside Hydra (a run
    from Python: what differs from the defaults is not recorded)."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:  # pragma: no cover - Hydra is a dependency
        return None
    if not HydraConfig.initialized():
        return None
    task = HydraConfig.get().overrides.task
    return [str(o) for o in task if not str(o).lstrip("+~").startswith(("hydra.", "hydra/"))]


def _timings(run) -> tuple[float, float, float, int]:
    """``(eval_seconds, compile_seconds, train_seconds, train_steps)`` of ``run``: ``summary.json``'s
    ``steps_per_sec`` is the fit's training steps per second of training, evaluation and compilation left
    out, as each log's is for the steps since the previous log."""
    return run.eval_seconds, run.compile_seconds, run.train_seconds, run.train_steps
