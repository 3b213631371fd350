"""The step's functions compiled with ``torch.compile`` (``step.py`` says when): ``csframework.step``'s
sequence with the compiled forward, the compiled (or fused) update and the compiled evaluation in it.

Each compiled function is ``Guarded``: timed while it compiles, its recompilations and graph breaks reported
(``session``); past csframework's recompile bound its runner replaces it by the eager function, once; when
compiling fails, the runner is replaced by the eager one, once, and that call runs eagerly.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ...graph import optim as graph_optim
from ...graph.optim import preinitialisable, preinitialize
from ...precision import NO_AUTOCAST
from ..eager_step import EagerRunner, Install
from .findings import compile_failure
from .scope import fresh
from .session import CompileSession
from .update import fused_on_cpu, raw_step, torch_optimizer


class Guarded:
    """``compiled`` (a function ``torch.compile`` made of ``eager``) as its ``owner`` runner calls it."""

    def __init__(self, session: CompileSession, owner: Any, name: str, compiled: Callable, eager: Callable):
        self.session, self.owner, self.name, self.compiled, self.eager = session, owner, name, compiled, eager
        # CUDA graphs (reduce-overhead) reuse their output buffers at the next replay: a new step is marked
        # and the forward's outputs, which the loop keeps until the next log, are copied out of them
        self.graphed = session.mode == "reduce-overhead" and session.device.type == "cuda" and name != "update"

    def __call__(self, *args):
        session = self.session
        session.scope.enter()
        graphs = session.recorder.graphs
        start = time.perf_counter()
        try:
            if self.graphed:
                torch.compiler.cudagraph_mark_step_begin()
                out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.compiled(*args).items()}
            else:
                out = self.compiled(*args)
        except Exception as e:
            reason = compile_failure(e)
            if reason is None:
                raise session.fullgraph_error(e) if session.is_break(e) else e
            self.owner.fail(reason)
            return self.eager(*args)
        if session.recorder.graphs != graphs:  # it compiled now
            spent = time.perf_counter() - start
            session.seconds += spent
            for name in session.compiled(self.name, args, seconds=spent):
                self.owner.make_eager(name)
        return out


def model_function(session: CompileSession, owner: Any, name: str, eager: Callable) -> Guarded:
    """The forward or evaluation (``eager``: the model's outputs under autocast) compiled: whole, or run eagerly
    with its repeated blocks compiled (``regions``); a copy of its own (``fresh``): Dynamo's caches are per code
    object, and never reset."""
    found = session.regions
    if found is None:
        return Guarded(session, owner, name, torch.compile(fresh(eager), **session.options), eager)

    def with_regions(batch):
        with found.installed():
            return eager(batch)

    return Guarded(session, owner, name, with_regions, eager)


class PerFunctionRunner(EagerRunner):
    """The step's runner under ``backend.compile`` when the step is not one graph: the compiled forward (its
    autocast inside, so ``autocast`` is no context here), the compiled update (clipping included: the step
    then clips nothing itself), the precision policy's other primitives, and the compiled evaluation."""

    def __init__(self, session: CompileSession, *, install: Install, max_grad_norm: float | None,
                 evaluate: Guarded | None = None, **layout):
        super().__init__(session.precision, session.module, max_grad_norm=max_grad_norm, **layout)
        self.session, self.install, self.clip_norm = session, install, max_grad_norm
        self.autocast = lambda: NO_AUTOCAST
        self.forward = model_function(session, self, "forward", self.outputs)
        if evaluate is not None:  # (the whole step's, which this runner replaces)
            evaluate.owner = self
        self.evaluate = evaluate or model_function(session, self, "evaluate", self.outputs)  # type: ignore[method-assign]
        self._setup_update()

    def _setup_update(self) -> None:
        """The update (clipping and the optimizer's step): torch's fused kernel, eagerly, on a CPU where it has one
        (faster there than the compiled one, and nothing to compile); else compiled as one function; under FSDP2
        (its DTensor parameters' update calls collectives) or a ``GradScaler`` kept, the precision policy's."""
        session, optimizer = self.session, self.session.run.optimizer
        if not self.sharded and session.scaler is None and fused_on_cpu(optimizer, session.device, self.module):
            session.update = "fused"
            session.prepare_optimizer()
            return
        if self.sharded or (session.scaler is not None and session.loss_scaler is None):
            return
        session.update = "compiled"
        session.prepare_optimizer()
        preinitialize(optimizer)  # the state the first step would create: then no cause of a recompilation
        if session.loss_scaler is None:
            self._step = raw_step(optimizer)
        else:  # the traceable update, which skips an overflowing step with torch.where (no synchronisation)
            self._step = lambda skip: graph_optim.step(optimizer, skip=skip)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        compiled = Guarded(session, self, "update", torch.compile(fresh(self._update), **session.options),
                           self._update)
        # an optimizer that creates its state in its first step (neither torch's nor preinitialisable) takes
        # that step eagerly: compiled, the next step would find new state and compile again
        eager_first = not (preinitialisable(type(optimizer)) or torch_optimizer(optimizer))
        self.update_function: Callable = self._first_update(compiled) if eager_first else compiled
        self.optimizer_step = self._apply_update
        self.max_grad_norm = None  # the compiled update clips

    def _update(self, skip: torch.Tensor | None = None) -> None:
        if self.clip_norm:
            torch.nn.utils.clip_grad_norm_(self._params, self.clip_norm)
        self._step(skip)

    def _first_update(self, compiled: Guarded) -> Callable:
        def eagerly(skip):
            self.update_function = compiled  # replaced once: every later update is compiled
            self._update(skip)
        return eagerly

    def _apply_update(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor | None) -> None:
        """Clip and step the optimizer, under ``no_grad`` as the optimizer's own; ``skip`` (in-graph loss
        scaling's overflow flag) leaves everything as it was."""
        with torch.no_grad():
            self.update_function(skip)
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what torch's LR schedulers check

    def make_eager(self, name: str) -> None:
        """``name`` runs eagerly from now on (csframework's recompile bound)."""
        if name in ("forward", "evaluate"):
            setattr(self, name, self.outputs)
        elif name == "update":
            self.update_function = self._update

    def fail(self, reason: str) -> None:
        """Compiling failed: the eager runner replaces this one (once)."""
        if self.session.fall_back(reason):
            self.install(EagerRunner(self.session.precision, self.module, max_grad_norm=self.clip_norm,
                                     **self.layout()))

    def train_eagerly(self, run: Any, batch: Any) -> None:
        """The same step with the model's functions eager (the update as it is: torch's capturable update runs on a
        GPU only): the payoff check's eager step."""
        forward, self.forward = self.forward, self.outputs
        try:
            self.train_batch(run, batch, True)
        finally:
            self.forward = forward
