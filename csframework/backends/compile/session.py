"""What compiling one stage's step costs and finds, shared by its runners (``step.runner``): the process's torch
settings while it compiles (``scope``), Inductor's cache, the backend handed to ``torch.compile`` (``Recorder``),
the seconds spent, recompilations, graph breaks and the fallback, each reported once, and ``summary.json``'s
``compile`` block."""
from __future__ import annotations

import traceback
from typing import Any, Callable

import torch

from ...errors import ConfigError
from ...graph.cachedir import trusted_root
from ...graph.compiler import Compiled
from ...graph.optim import preinitialisable
from ...graph.precision import GraphLossScaler, GraphPrecision
from . import mutation, regions
from .findings import COMPILER_ERRORS, Recorder, compiler_failure, describe_break, missing_compiler, one_line, signature
from .payoff import Verdict
from .scope import CompileScope, cache_dir, trust_vector_isa
from .update import prepare_optimizer
from .whole_step import batch_shapes

#: Compilations of one function after its first (new shapes) before it runs eagerly. A recompilation for any other
#: reason (a guard on a Python value failed: ``.item()`` in the forward, a counter the model reads) is its last.
MAX_RECOMPILES = 8
#: The compiled functions that run the model's forward.
MODEL_FUNCTIONS = ("forward", "evaluate")


class CompileSession:
    """One stage's compiling: its settings, what it has cost and found so far, and how it is reported."""

    def __init__(self, run, precision, module: torch.nn.Module, device: torch.device, *, mode: str, fullgraph: bool,
                 sharded: bool, whole: bool):
        self.run, self.module, self.device = run, module, device
        self.mode, self.fullgraph = mode, fullgraph
        self.failed: str | None = None  # why compiling failed (the runner was replaced by the eager one)
        self.seconds = 0.0
        self.recompiles: list[str] = []
        self.reported = self._changes_reported = self._unchecked_reported = 0  # findings already said
        self.eager_modules: list[str] = []  # the modules whose training graphs run eagerly (``mutation``)
        self.eager_functions: set[str] = set()  # the functions made eager (csframework's recompile bound)
        self._notes: list[Callable[[Any], None]] = []  # lines for the run's log once it is logging (in fit)
        self._shapes: dict[str, tuple] = {}
        self.graph_loads = self.graph_compiles = 0  # the whole step's graphs loaded from the cache, compiled
        self.whole = whole  # the step runs as one graph (until it is not one graph after all)
        #: the update of the step's functions: ``compiled``, ``fused`` (torch's fused kernel, eagerly) or ``""``
        #: (the precision policy's, eagerly); set by ``functions.PerFunctionRunner``
        self.update = ""
        if mode == "reduce-overhead" and device.type == "cpu":
            self.note(lambda log: log.info("compile_mode", mode=mode, result="on a CPU it compiles as default does: "
                                           "its CUDA graphs (the launch overhead it saves) exist on a GPU only"))
        self.cache_counts = self._cache_counts()
        # Inductor imports what its cache holds: only a cache of this user's alone, and writable, is used (cachedir.py)
        self.warn_cache = lambda problem: run.log.warning("compile_cache_untrusted", problem=problem)
        self.cache_root = trusted_root(cache_dir(), self.warn_cache, writable=True)  # Inductor writes there
        # the process's torch settings, csframework's while its compiled code runs (the caller's again by close());
        # torch's bound is above csframework's, per code object (a function's graph breaks make several)
        debug = bool(getattr(run.config, "debug", False))
        self.scope = CompileScope(str(self.cache_root), MAX_RECOMPILES + 2, None if debug else self._torch_log)
        if device.type == "cpu":
            self._check_compiler()
        # (a training graph that changes the model's parameters or buffers in place runs eagerly: ``mutation``)
        self.recorder = Recorder(mode, run.model)
        self.options: dict[str, Any] = dict(backend=self.recorder, fullgraph=fullgraph, dynamic=False)
        # a model of repeated blocks (a transformer's layers): each block's code compiled once for every layer, the
        # rest of the forward eager (``regions``); CUDA graphs would replay one block's buffers for every layer
        graphed = mode == "reduce-overhead" and device.type == "cuda"
        self.regions = None if whole or sharded or graphed else regions.find(
            module, lambda function: torch.compile(function, **self.options))
        self.precision = precision
        self.scaler = getattr(precision, "scaler", None)  # GradScaler, under dynamic loss scaling
        #: dynamic loss scaling as tensor operations (``graph/precision.py``), wherever the optimizer's update traces:
        #: the overflow check, the skipped update and the new scale are then compiled with the step (or with the
        #: update), and this scaler, not the ``GradScaler``, holds the scale (``GradScaler``'s state keys)
        self.loss_scaler: GraphLossScaler | None = None
        if self.scaler is not None and not sharded and preinitialisable(type(run.optimizer)) and not self.failed:
            self.precision = GraphPrecision(run.stage_config.precision, device)
            self.loss_scaler = self.precision.scaler
            self.loss_scaler.load_state_dict(self.scaler.state_dict())

    def _check_compiler(self) -> None:
        """Inductor's C++ compiler, and the CPU's vector instructions it builds for, checked before anything is
        compiled: without one the run goes on eagerly (one ``compile_failed`` warning), not with a traceback."""
        problem = missing_compiler()
        if problem is None:
            self.scope.enter()  # (the vector-instruction check builds in csframework's cache)
            try:
                self.scope.vec_isa_ok = trust_vector_isa(self.cache_root)
            except Exception as e:  # the compiler runs, but cannot build the check's programs
                problem = compiler_failure(one_line(e))
            finally:
                self.scope.close()
        if problem is not None:
            self.fall_back(problem)

    def note(self, say: Callable[[Any], None]) -> None:
        """``say(run.log)`` when the run logs (at the runner's first call, in ``fit``): the step is set up when the
        run is built, before its log is open."""
        self._notes.append(say)

    def log_notes(self) -> None:
        """Say the notes taken so far."""
        notes, self._notes = self._notes, []
        for say in notes:
            say(self.run.log)

    def _torch_log(self, record) -> None:
        """A record of torch's compile loggers: a ``torch_log`` event of the run (events.jsonl, not the console:
        csframework reports what matters once, in its own words)."""
        self.run.log.info("torch_log", logger=record.name, level=record.levelname,
                          message=" ".join(record.getMessage().split())[:2000], console=False)

    def close(self) -> None:
        """The end of the stage, of ``fit`` or ``validate``: the process's torch settings are the caller's again."""
        self.scope.close()

    def fall_back(self, reason: str) -> bool:
        """Compiling failed: say so once (``compile_failed``); returns whether this is the first failure (the caller
        then replaces its runner by the eager one)."""
        if self.failed is not None:
            return False
        if reason.startswith(COMPILER_ERRORS):  # found when it compiled: say which setting names the compiler
            reason = compiler_failure(reason)
        self.failed = reason
        self.note(lambda log: log.warning("compile_failed", problem=f"torch.compile failed: {reason}",
                                          result="the run goes on eagerly (backend.compile=false avoids the attempt)"))
        if self.run.status != "created":  # failed while the run logs (else: said at the runner's first call)
            self.log_notes()
        return True

    def prepare_optimizer(self) -> None:
        """The optimizer's settings for the compiled or fused update (again after a checkpoint is loaded, which
        brings back the saved ones); nothing where the update is the precision policy's."""
        if self.update:
            prepare_optimizer(self.run.optimizer, self.device, torch_step=self.loss_scaler is None,
                              fused=self.update == "fused")

    # -- what compiling found ---------------------------------------------------------------------------
    def whole_compiled(self, compiled: Compiled, seconds: float) -> None:
        """A graph of the whole step was compiled or loaded (before it runs): count and report it."""
        self.seconds += seconds
        if compiled.report.get("graph_compiler", {}).get("status") == "loaded":
            self.graph_loads += 1
        else:
            self.graph_compiles += 1
        self.compiled("train_step", (), shape=batch_shapes(compiled), seconds=seconds)

    def compiled(self, name: str, args: tuple, shape: tuple | None = None, seconds: float = 0.0) -> list[str]:
        """After a call that compiled (in ``seconds``): log the first compilation (its own seconds), report
        recompilations and new graph breaks; returns the functions that run eagerly from now on (their runner
        replaces them)."""
        self.log_notes()
        before = set(self.eager_functions)
        shape = signature(args) if shape is None else shape
        if name in self._shapes:
            self._recompiled(name, shape)
        else:
            self.run.log.info("step_compiled", function=name, mode=self.mode, seconds=round(seconds, 3),
                              cache=self.cache_status(), cache_dir=str(self.cache_root), graph=self.graph())
        self._shapes[name] = shape
        for found in self.recorder.breaks[self.reported:]:
            self.run.log.warning("graph_break", where=found.where, problem=str(found),
                                 result="that part of the step runs eagerly; backend.compile_fullgraph=true refuses it")
        self.reported = len(self.recorder.breaks)
        self._report_state_changes(name)
        return sorted(self.eager_functions - before)

    def _recompiled(self, name: str, shape: tuple) -> None:
        new_shape = shape != self._shapes[name]
        cause = (f"new input shapes {shape} (compiled for {self._shapes[name]})" if new_shape
                 else "a guard failed (a module's train/eval mode, an optimizer setting or a Python value "
                      "the function reads changed)")
        self.recompiles.append(f"{name}: {cause}")
        # a Python value that changes (``.item()`` in the forward, a counter) would recompile at every step
        limited = len([r for r in self.recompiles if r.startswith(name + ":")]) == MAX_RECOMPILES
        if limited:
            self.eager_functions.add(name)
        elif not new_shape:  # the model's code reads the value: evaluation runs it too
            self.eager_functions.update(MODEL_FUNCTIONS if name in MODEL_FUNCTIONS else (name,))
        self.run.log.info("recompiled", function=name, cause=cause, recompiles=len(self.recompiles),
                          limit=f"{MAX_RECOMPILES} per function for new shapes, one for a changed value",
                          **({"result": f"{name} runs eagerly from now on"} if name in self.eager_functions else {}))
        if limited:
            self.run.log.warning("recompile_limit", function=name, limit=MAX_RECOMPILES,
                                 problem=f"{name} was compiled {MAX_RECOMPILES + 1} times (last: {cause}); from "
                                         "now on it runs eagerly: keep the batch shapes fixed "
                                         "(data.drop_last=true, padding to a few lengths)")

    def _report_state_changes(self, name: str) -> None:
        """The warning for each new graph that runs eagerly because it changes model state (``mutation``)."""
        blocks = self.regions.blocks if self.regions is not None else []
        for changes in self.recorder.state_changes[self._changes_reported:]:
            self.eager_modules.append(mutation.warn(self.run.log, changes, name, self.run.model, blocks))
        for reason in self.recorder.unchecked[self._unchecked_reported:]:
            self.run.log.info("state_check_failed", function=name, reason=reason)
        self._changes_reported, self._unchecked_reported = len(self.recorder.state_changes), len(self.recorder.unchecked)

    def whole_step_full(self) -> None:
        """The whole step has its last graph: batches of other shapes run eagerly (said once)."""
        self.run.log.warning("recompile_limit", function="train_step", limit=MAX_RECOMPILES,
                             problem=f"train_step was compiled {MAX_RECOMPILES + 1} times; from now on new shapes "
                                     "run eagerly: keep the batch shapes fixed (data.drop_last=true, padding to a "
                                     "few lengths)")

    def untraced(self, problem: str) -> None:
        """A later batch shape does not trace: that batch runs eagerly."""
        self.run.log.warning("step_not_traced", problem=problem, result="this batch runs eagerly")

    def not_faster(self, found: Verdict, steps: int | None) -> None:
        """The payoff check's verdict: one ``compile_not_faster`` warning, unless a graph break, a function made
        eager or a graph changing model state has had its own (the step is not all compiled then)."""
        if not self.recorder.breaks and not self.eager_functions and not self.recorder.state_changes:
            self.run.log.warning("compile_not_faster", **found.event(self.seconds, steps))

    def is_break(self, error: BaseException) -> bool:
        """Whether ``error`` is Dynamo refusing a graph break under ``compile_fullgraph``."""
        from torch._dynamo.exc import Unsupported, UserError

        return self.fullgraph and isinstance(error, (Unsupported, UserError))

    def fullgraph_error(self, error: BaseException) -> ConfigError:
        """``compile_fullgraph=true`` and Dynamo could not capture the whole function: a one-line error naming
        the user's line (no step has changed anything yet)."""
        stack = list(getattr(error, "real_stack", None) or []) or traceback.extract_tb(error.__traceback__)
        found = describe_break(str(error), stack)
        return ConfigError(f"backend.compile_fullgraph: the step does not compile into one graph: {found}; "
                           "or set backend.compile_fullgraph=false to run that part eagerly")

    # -- figures ------------------------------------------------------------------------------------------
    @staticmethod
    def _cache_counts() -> tuple[int, int]:
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]

    def cache_status(self) -> str:
        """``hit`` when every graph compiled so far came from the cache (Inductor's, or the whole step's
        artifacts), else ``miss``."""
        hits, misses = (now - before for now, before in zip(self._cache_counts(), self.cache_counts))
        hits, misses = hits + self.graph_loads, misses + self.graph_compiles
        return "hit" if hits and not misses else "miss"

    def graph(self) -> str:
        """How the step is compiled: ``whole step`` (one graph) or ``per function``."""
        return "whole step" if self.whole and self.failed is None else "per function"

    def summary(self) -> dict:
        """``summary.json``'s ``compile`` block."""
        out = {"mode": self.mode, "seconds": round(self.seconds, 3), "cache": self.cache_status(),
               "graph_breaks": len(self.recorder.breaks), "recompiles": len(self.recompiles),
               "graph": self.graph()}
        if self.regions is not None:
            out["regions"] = regions.describe(self.regions.blocks)
        if self.eager_modules:  # the modules whose training graphs run eagerly (``mutation``)
            out["eager"] = self.eager_modules
        if self.failed is not None:
            out["fallback"] = self.failed
        return out
