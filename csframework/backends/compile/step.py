"""``backend.compile=true``: the eager backend's step and evaluation compiled.

In one CPU process the whole step is one traced graph where it can be (``whole_step``: the fastest there);
``CompiledStep`` sets that up and reports on it as on the rest. Otherwise (GPU, DDP/FSDP, gradient accumulation,
hooks inside the step, a step that does not trace) the step's sequence is still
``csframework.step``'s and three functions of it are compiled (TorchDynamo captures them, TorchInductor
generates their code):

* ``forward``: a micro-batch's forward and loss under the precision policy's autocast. AOTAutograd compiles its
  backward with it, so ``loss.backward()`` runs compiled code too (the loss scaling's multiplication, the
  ``1/grad_accum_steps`` division and the call itself stay eager: one operation each);
* ``update``: the gradient clipping and the optimizer's step (built-in or ``_target_``), one graph (on a CPU,
  torch's optimizers that have a fused kernel, Adam, AdamW, SGD and Adagrad, run it eagerly instead: faster than
  the compiled update there, and nothing to compile). Every
  optimizer's learning rates become tensors that the schedule fills in place, so a new rate is an input, not a
  recompilation (another optimizer's ``step`` reads it as a number); torch's optimizers, and subclasses keeping
  torch's ``step``, run their ``foreach`` path with ``capturable`` state (the fastest compiled update measured:
  docs/performance.md). Under dynamic loss scaling (``precision=float16``) the scaling
  is tensor operations, as on CSX (``graph/precision.GraphLossScaler``): the gradients are unscaled with one
  overflow check and the scale updated (one kernel each, between the compiled functions), and the compiled update
  is ``graph/optim``'s traceable optimizer step, which skips an overflowing step with ``torch.where``: nothing waits
  for the device. A custom optimizer that cannot create its state before the first step keeps ``GradScaler``
  and runs its update eagerly;
* ``evaluate``: evaluation's forward and loss.

Compiled per function, a model of repeated blocks (a transformer's layers) is compiled by region (``regions``):
each block class's ``forward`` once, run for every layer, the rest of the forward and evaluation eager around it.
On the CPU ``payoff`` times the compiled step against a few eager ones and says when compiling does not pay.

Zeroing the gradients (``set_to_none``) is no operation. Plugin hooks run between the compiled functions, as
everywhere: data-dependent code in a hook is no graph break. Data-dependent code in the model (``.item()``,
``if tensor:``) is: Dynamo runs that part eagerly, and ``graph_breaks`` reports it once, naming the user's file
and line, the reason and the fix; ``backend.compile_fullgraph=true`` makes it an error before the first step
changes anything. Each function is compiled for fixed shapes: a new input shape (the short last batch)
compiles once more and is then reused every epoch; ``MAX_RECOMPILES`` bounds them (then that function runs
eagerly), and each is reported with its cause. A recompilation for a Python value that changed (the value of an
``.item()`` before a branch) would come at every step: after the first, the function runs eagerly.

Inductor's cache (``cache_dir()``) keeps the generated code across runs, so an identical run compiles from it.
When compiling fails (no C++ compiler: checked first; an Inductor error) the run goes on eagerly with one
warning. The process-wide torch settings this needs are held only while the run uses them (``scope``).
"""
from __future__ import annotations

import time
import traceback
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from ... import step
from ...errors import ConfigError
from ...graph import optim as graph_optim
from ...graph.cachedir import trusted_root
from ...graph.compiler import CompileCache, Compiled
from ...graph.optim import preinitialisable, preinitialize
from ...graph.precision import GraphLossScaler, GraphPrecision
from ...precision import NO_AUTOCAST
from . import mutation, regions
from .findings import (COMPILER_ERRORS, Recorder, compile_failure, compiler_failure, describe_break,
                       missing_compiler, one_line, signature)
from .payoff import Payoff
from .scope import CompileScope, cache_dir, fresh, trust_vector_isa
from .update import fused_on_cpu, prepare_optimizer, raw_step, torch_optimizer
from .whole_step import WholeStep, batch_shapes

#: Compilations of one function after its first (new shapes) before it runs eagerly. A recompilation for any other
#: reason (a guard on a Python value failed: ``.item()`` in the forward, a counter the model reads) is its last.
MAX_RECOMPILES = 8


#: The compiled functions that run the model's forward.
MODEL_FUNCTIONS = ("forward", "evaluate")


class CompiledStep:
    """The compiled step of one stage's eager backend, and what compiling it cost and found: the whole step as
    one graph (``whole``: ``whole_step``), or its functions compiled with ``torch.compile``."""

    def __init__(self, run, precision, module: torch.nn.Module, device: torch.device, max_grad_norm: float | None,
                 *, mode: str, fullgraph: bool, sharded: bool, whole: bool = False, payoff: Payoff | None = None):
        self.run, self.precision, self.module, self.device = run, precision, module, device
        self.max_grad_norm = max_grad_norm
        self.mode, self.fullgraph = mode, fullgraph
        self.failed: str | None = None  # why compiling failed: everything then runs eagerly
        self.seconds = 0.0
        self.recompiles: list[str] = []
        self.reported = self._changes_reported = self._unchecked_reported = 0  # findings already said
        self.eager_modules: list[str] = []  # the modules whose training graphs run eagerly (``mutation``)
        self.eager: set[str] = set()  # the functions that run eagerly from now on (csframework's recompile bound)
        self._notes: list[Callable[[Any], None]] = []  # lines for the run's log once it is logging (in fit)
        self.payoff = payoff  # whether the compiled step is faster than the eager one, measured (``payoff``)
        self._eager_now = False  # the payoff check's eager steps: the compiled code set aside
        if mode == "reduce-overhead" and device.type == "cpu":
            self.note(lambda log: log.info("compile_mode", mode=mode, result="on a CPU it compiles as default does: "
                                           "its CUDA graphs (the launch overhead it saves) exist on a GPU only"))
        self.cache_counts = self._cache_counts()
        # Inductor imports what its cache holds: only a cache of this user's alone, and writable, is used (cachedir.py)
        self._warn_cache = lambda problem: run.log.warning("compile_cache_untrusted", problem=problem)
        self.cache_root = trusted_root(cache_dir(), self._warn_cache, writable=True)  # Inductor writes there
        # the process's torch settings, csframework's while its compiled code runs (the caller's again by close());
        # torch's bound is above csframework's, per code object (a function's graph breaks make several)
        debug = bool(getattr(run.config, "debug", False))
        self.scope = CompileScope(str(self.cache_root), MAX_RECOMPILES + 2, None if debug else self._torch_log)
        if device.type == "cpu":
            self._check_compiler()
        # (a training graph that changes the model's parameters or buffers in place runs eagerly: ``mutation``)
        self.recorder = Recorder(mode, run.model)
        options: dict[str, Any] = dict(backend=self.recorder, fullgraph=fullgraph, dynamic=False)
        self.options = options
        # a model of repeated blocks (a transformer's layers): each block's code compiled once for every layer, the
        # rest of the forward eager (``regions``); CUDA graphs would replay one block's buffers for every layer
        graphed = mode == "reduce-overhead" and device.type == "cuda"
        self.regions = None if whole or sharded or graphed else regions.find(
            module, lambda function: torch.compile(function, **options))
        # functions of this step's own (``fresh``): Dynamo's caches are per code object, and never reset
        self.forward = self._guarded("forward", self._compiled_model_function(self._forward))
        self.evaluate = self._guarded("evaluate", self._compiled_model_function(self._evaluate))
        self.scaler = getattr(precision, "scaler", None)  # GradScaler, under dynamic loss scaling
        #: dynamic loss scaling as tensor operations (``graph/precision.py``), wherever the optimizer's update traces:
        #: the overflow check, the skipped update and the new scale are then compiled with the step (or with the
        #: update), and this scaler, not the ``GradScaler``, holds the scale (``GradScaler``'s state keys)
        self.loss_scaler: GraphLossScaler | None = None
        if self.scaler is not None and not sharded and preinitialisable(type(run.optimizer)):
            self.precision = GraphPrecision(run.stage_config.precision, device)
            self.loss_scaler = self.precision.scaler
            self.loss_scaler.load_state_dict(self.scaler.state_dict())
        self._shapes: dict[str, tuple] = {}
        self.compiled_update = False
        #: the update run eagerly by torch's fused kernel (``update.fused_on_cpu``): on a CPU it is faster than the
        #: compiled one and compiles nothing (its compile was most of the per-function path's first compile)
        self.fused_update = False
        self._eager_updates = 0  # updates still to run eagerly before the compiled one
        self.whole: WholeStep | None = None  # the whole step as one graph (CPU), else the functions compiled
        self.graph_loads = self.graph_compiles = 0  # the whole step's graphs loaded from the cache, compiled
        self._limit_reported = False
        if self.failed is not None:
            return
        if whole:
            self.whole = WholeStep(run, self.precision, max_grad_norm, cache=CompileCache(self.cache_root / f"steps-{mode}",
                                                                                     self._warn_cache),
                                   max_graphs=MAX_RECOMPILES + 1, config_patches=self.recorder.options,
                                   on_compile=self._whole_compiled, on_untraced=self._whole_untraced)
        else:
            self._compile_update(sharded)

    def _compile_update(self, sharded: bool) -> None:
        """The update (clipping and the optimizer's step): torch's fused kernel, eagerly, on a CPU where it has one;
        else compiled as one function."""
        optimizer = self.run.optimizer
        self.fused_update = not sharded and self.scaler is None and fused_on_cpu(optimizer, self.device, self.module)
        if self.fused_update:
            self.prepare_optimizer()
            return
        # FSDP2's parameters are DTensors whose update calls collectives: left to the eager optimizer
        self.compiled_update = not sharded and (self.scaler is None or self.loss_scaler is not None)
        if self.compiled_update:
            self.prepare_optimizer()
            # the state the first step would create, created now: it is then no cause of a recompilation
            preinitialize(optimizer)
            if self.loss_scaler is None:
                self._step = raw_step(optimizer)
            else:  # the traceable update, which skips an overflowing step with torch.where (no synchronisation)
                self._step = lambda skip: graph_optim.step(optimizer, skip=skip)
            self._params = [p for g in optimizer.param_groups for p in g["params"]]
            self.update = self._guarded("update", torch.compile(fresh(self._update), **self.options))
            # an optimizer that creates its state in its first step (neither torch's nor preinitialisable) takes
            # that step eagerly: compiled, the next step would find new state and compile again
            self._eager_updates = 0 if preinitialisable(type(optimizer)) or torch_optimizer(optimizer) else 1

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
            self._fall_back(problem)

    def note(self, say: Callable[[Any], None]) -> None:
        """``say(run.log)`` when the run logs (at its first compiled call, in ``fit``): the step is set up when the
        run is built, before its log is open."""
        self._notes.append(say)

    def _log_notes(self) -> None:
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

    # -- the compiled functions ---------------------------------------------------------------------------
    def _forward(self, batch):
        with self.precision.autocast():
            return step.model_outputs(self.module(batch))

    def _evaluate(self, batch):
        with self.precision.autocast():
            return step.model_outputs(self.module(batch))

    def _compiled_model_function(self, method: Callable) -> Callable:
        """``method`` (the forward or evaluation) compiled: whole, or run eagerly with its repeated blocks
        compiled (``regions``)."""
        found = self.regions
        if found is None:
            return torch.compile(fresh(method), **self.options)

        def with_regions(batch):
            with found.installed():
                return method(batch)

        return with_regions

    def _update(self, skip: torch.Tensor | None = None):
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
        self._step(skip)

    # -- the whole step as one graph ------------------------------------------------------------------------
    def train_whole(self, batch, global_step: int) -> dict | None:
        """Train on ``batch`` with the whole step's graph; ``None`` when the step is not one graph after all (it
        does not trace: its functions are compiled from now on; Inductor failed: the run goes on eagerly) and the
        caller runs it through the compiled functions."""
        if self._notes:
            self._log_notes()
        whole = self.whole
        if whole is None or self.failed is not None:
            return None
        if self._eager_now:
            return whole.eager(batch)
        self.scope.enter()
        outputs = whole(batch, global_step)
        if outputs is None:
            self._leave_whole_step(*(whole.refused or ("compile", "unknown")))
            return None
        if whole.full and not self._limit_reported:
            self._limit_reported = True
            self.run.log.warning("recompile_limit", function="train_step", limit=MAX_RECOMPILES,
                                 problem=f"train_step was compiled {MAX_RECOMPILES + 1} times; from now on new shapes "
                                         "run eagerly: keep the batch shapes fixed (data.drop_last=true, padding to a "
                                         "few lengths)")
        return outputs

    def _leave_whole_step(self, why: str, reason: str) -> None:
        """The step is not one graph after all: the functions compiled instead (it did not trace), or eagerly
        (Inductor failed, ``why == "compile"``)."""
        self.whole = None
        if why == "compile":
            self._fall_back(reason)
            return
        # data-dependent code: Dynamo compiles what it can and reports the graph breaks
        self.run.log.info("step_compiled_per_function", reason=reason)
        self._compile_update(sharded=False)

    def _whole_untraced(self, problem: str) -> None:
        """A later batch shape does not trace: that batch runs eagerly."""
        self.run.log.warning("step_not_traced", problem=problem, result="this batch runs eagerly")

    def timed(self, global_step: int, train: Callable[[], dict]) -> dict:
        """``train()``, the step at ``global_step``, timed for the payoff check (run eagerly where it asks), and its
        ``compile_not_faster`` warning once it has the figures."""
        payoff = self.payoff
        if payoff is None or self.failed is not None:
            return train()
        self._eager_now = payoff.eager_step(global_step)
        try:
            outputs = payoff.step(global_step, train, lambda: self.seconds)
        finally:
            self._eager_now = False
        found = payoff.verdict(self.seconds)
        # (a graph break, or a function that runs eagerly, has had its own warning: the step is not all compiled)
        if found is not None and not self.recorder.breaks and not self.eager and not self.recorder.state_changes:
            self.run.log.warning("compile_not_faster", **found.event(self.seconds, payoff.steps))
        return outputs

    def prepare_optimizer(self) -> None:
        """The optimizer's settings for the compiled update (again after a checkpoint is loaded)."""
        prepare_optimizer(self.run.optimizer, self.device, torch_step=self.loss_scaler is None, fused=self.fused_update)

    def _whole_compiled(self, compiled: Compiled, seconds: float) -> None:
        """A graph of the whole step was compiled or loaded (before it runs): count and report it."""
        self.seconds += seconds
        if compiled.report.get("graph_compiler", {}).get("status") == "loaded":
            self.graph_loads += 1
        else:
            self.graph_compiles += 1
        self._compiled("train_step", (), shape=batch_shapes(compiled), seconds=seconds)

    # -- calling them -------------------------------------------------------------------------------------
    def _guarded(self, name: str, compiled: Callable) -> Callable:
        """``compiled`` timed while it compiles, its recompilations and graph breaks recorded, and the eager
        function run instead once compiling has failed."""
        eager = getattr(self, f"_{name}")
        # CUDA graphs (reduce-overhead) reuse their output buffers at the next replay: a new step is marked
        # and the forward's outputs, which the loop keeps until the next log, are copied out of them
        graphed = self.mode == "reduce-overhead" and self.device.type == "cuda" and name != "update"

        def call(*args):
            if self._notes:
                self._log_notes()
            # (the payoff check's eager steps keep the update compiled: torch's capturable update runs eagerly on
            # a GPU only)
            if self.failed is not None or name in self.eager or self._eager_now and name in MODEL_FUNCTIONS:
                return eager(*args)
            self.scope.enter()
            graphs = self.recorder.graphs
            start = time.perf_counter()
            try:
                if graphed:
                    torch.compiler.cudagraph_mark_step_begin()
                    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in compiled(*args).items()}
                else:
                    out = compiled(*args)
            except Exception as e:
                reason = compile_failure(e)
                if reason is None:
                    raise self._fullgraph_error(e) if self._is_break(e) else e
                self._fall_back(reason)
                return eager(*args)
            if self.recorder.graphs != graphs:  # it compiled now
                spent = time.perf_counter() - start
                self.seconds += spent
                self._compiled(name, args, seconds=spent)
            return out

        return call

    def _compiled(self, name: str, args: tuple, shape: tuple | None = None, seconds: float = 0.0) -> None:
        """After a call that compiled (in ``seconds``): log the first compilation (its own seconds), report
        recompilations and new graph breaks."""
        shape = signature(args) if shape is None else shape
        if name in self._shapes:
            new_shape = shape != self._shapes[name]
            cause = (f"new input shapes {shape} (compiled for {self._shapes[name]})" if new_shape
                     else "a guard failed (a module's train/eval mode, an optimizer setting or a Python value "
                          "the function reads changed)")
            self.recompiles.append(f"{name}: {cause}")
            # a Python value that changes (``.item()`` in the forward, a counter) would recompile at every step
            limited = len([r for r in self.recompiles if r.startswith(name + ":")]) == MAX_RECOMPILES
            if limited:
                self.eager.add(name)
            elif not new_shape:  # the model's code reads the value: evaluation runs it too
                self.eager.update(MODEL_FUNCTIONS if name in MODEL_FUNCTIONS else (name,))
            self.run.log.info("recompiled", function=name, cause=cause, recompiles=len(self.recompiles),
                              limit=f"{MAX_RECOMPILES} per function for new shapes, one for a changed value",
                              **({"result": f"{name} runs eagerly from now on"} if name in self.eager else {}))
            if limited:
                self.run.log.warning("recompile_limit", function=name, limit=MAX_RECOMPILES,
                                     problem=f"{name} was compiled {MAX_RECOMPILES + 1} times (last: {cause}); from "
                                             "now on it runs eagerly: keep the batch shapes fixed "
                                             "(data.drop_last=true, padding to a few lengths)")
        else:
            self.run.log.info("step_compiled", function=name, mode=self.mode, seconds=round(seconds, 3),
                              cache=self.cache_status(), cache_dir=str(self.cache_root), graph=self.graph())
        self._shapes[name] = shape
        for found in self.recorder.breaks[self.reported:]:
            self.run.log.warning("graph_break", where=found.where, problem=str(found),
                                 result="that part of the step runs eagerly; backend.compile_fullgraph=true refuses it")
        self.reported = len(self.recorder.breaks)
        self._report_state_changes(name)

    def _report_state_changes(self, name: str) -> None:
        """The warning for each new graph that runs eagerly because it changes model state (``mutation``)."""
        blocks = self.regions.blocks if self.regions is not None else []
        for changes in self.recorder.state_changes[self._changes_reported:]:
            self.eager_modules.append(mutation.warn(self.run.log, changes, name, self.run.model, blocks))
        for reason in self.recorder.unchecked[self._unchecked_reported:]:
            self.run.log.info("state_check_failed", function=name, reason=reason)
        self._changes_reported, self._unchecked_reported = len(self.recorder.state_changes), len(self.recorder.unchecked)

    def _is_break(self, error: BaseException) -> bool:
        from torch._dynamo.exc import Unsupported, UserError

        return self.fullgraph and isinstance(error, (Unsupported, UserError))

    def _fullgraph_error(self, error: BaseException) -> ConfigError:
        """``compile_fullgraph=true`` and Dynamo could not capture the whole function: a one-line error naming
        the user's line (no step has changed anything yet)."""
        stack = list(getattr(error, "real_stack", None) or []) or traceback.extract_tb(error.__traceback__)
        found = describe_break(str(error), stack)
        return ConfigError(f"backend.compile_fullgraph: the step does not compile into one graph: {found}; "
                           "or set backend.compile_fullgraph=false to run that part eagerly")

    def _fall_back(self, reason: str) -> None:
        if reason.startswith(COMPILER_ERRORS):  # found when it compiled: say which setting names the compiler
            reason = compiler_failure(reason)
        self.failed = reason
        self.note(lambda log: log.warning("compile_failed", problem=f"torch.compile failed: {reason}",
                                          result="the run goes on eagerly (backend.compile=false avoids the attempt)"))
        if self.run.status != "created":  # failed while the run logs (else: said at its first compiled call)
            self._log_notes()

    def apply_update(self, skip: torch.Tensor | None = None) -> None:
        """Clip and step the optimizer (compiled when it can be), under ``no_grad`` as the optimizer's own; ``skip``
        (in-graph loss scaling's overflow flag) leaves everything as it was."""
        with torch.no_grad():
            if self._eager_updates:
                self._eager_updates -= 1
                self._update(skip)
            else:
                self.update(skip)
        self.run.optimizer._opt_called = True  # what torch's LR schedulers check, as a wrapped step sets it

    @property
    def update_compiled(self) -> bool:
        """Whether the compiled update (clipping and the optimizer's step) runs: set up, and compiling has not
        failed (the fallback rule, in one place)."""
        return self.compiled_update and self.failed is None

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
        return "whole step" if self.whole is not None and self.failed is None else "per function"

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


class CompiledOps:
    """The step's runner under ``backend.compile`` when the step is not one graph: ``csframework.step``'s
    sequence with the compiled forward (``forward``: its autocast inside, so ``autocast`` is no context here) and
    the compiled update (``optimizer_step``, clipping included: ``clip`` gives the step no ``max_grad_norm``
    then), the precision policy's other primitives (``step.PrecisionOps``), and the compiled evaluation."""

    def __init__(self, compiled: CompiledStep):
        self.precision, self.compiled = compiled.precision, compiled
        self.forward, self.evaluate = compiled.forward, compiled.evaluate

    def clip(self, max_grad_norm: float | None) -> float | None:
        """The clipping the step does itself: none while the compiled update clips."""
        return None if self.compiled.update_compiled else max_grad_norm

    def autocast(self) -> AbstractContextManager:
        return NO_AUTOCAST

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> Any:
        return self.precision.unscale(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, skip: Any) -> None:
        if self.compiled.update_compiled:
            self.compiled.apply_update(skip)
        else:
            self.precision.optimizer_step(optimizer, skip)

    def update(self) -> None:
        self.precision.update()
