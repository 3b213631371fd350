"""``backend.compile=true``: the eager backend's step and evaluation compiled; ``runner`` chooses how, once.

In one CPU process the whole step is one traced graph where it can be (``whole_runner.WholeStepRunner``: the
fastest there). Otherwise (GPU, DDP/FSDP, gradient accumulation, hooks inside the step, a step that does not
trace: ``functions.PerFunctionRunner``) the step's sequence is still ``csframework.step``'s and three functions of
it are compiled (TorchDynamo captures them, TorchInductor generates their code):

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
On the CPU ``payoff`` times the compiled step against a few eager ones, thrown away, and says when compiling
does not pay (``Opening``: the runner in front of the chosen one for the first steps).

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
warning: the runner is replaced by the eager one, once. What compiling costs and finds is the ``session``'s, shared
by the runners of a stage; the process-wide torch settings this needs are held only while the run uses them
(``scope``).
"""
from __future__ import annotations

from typing import Any

import torch

from ...graph.compiler import CompileCache
from ..eager_step import EagerRunner, Install, StepRunner
from . import regions, whole_step
from .functions import Guarded, PerFunctionRunner
from .payoff import Payoff, set_aside, unobserved
from . import COMPILE_MODES
from .session import MAX_RECOMPILES, MODEL_FUNCTIONS, CompileSession
from .whole_runner import WholeStepRunner
from .whole_step import WholeStep

__all__ = ["COMPILE_MODES", "MAX_RECOMPILES", "MODEL_FUNCTIONS", "CompileSession", "Opening", "runner"]


def runner(run, precision, device: torch.device, *, install: Install, mode: str, fullgraph: bool,
           whole_step_setting: bool | None, accum: int, distributed: bool, sharded: bool,
           max_grad_norm: float | None) -> tuple[CompileSession, StepRunner]:
    """The stage's compile session and its runner, chosen once from plain values: the whole step as one graph
    where ``whole_step.refusal`` finds nothing against it (``whole_step_setting``: ``backend.compile_whole_step``),
    else the step's functions compiled; the eager runner where compiling cannot start. ``install`` puts a runner
    where the backend calls it (a fallback replaces the runner through it, once)."""
    # (null: a model of repeated blocks is compiled per function, each block once)
    repeated = (regions.describe(regions.repeated_blocks(run.module))
                if whole_step_setting is None and regions.unavailable() is None else "")
    refused = whole_step.refusal(device_type=device.type, distributed=distributed, accum=accum,
                                 optimizer=type(run.optimizer), hooked=whole_step.in_step_hooks(run.hooks.pm.hook),
                                 repeated=repeated) if whole_step_setting is not False else None
    whole = whole_step_setting is not False and refused is None
    session = CompileSession(run, precision, run.module, device, mode=mode, fullgraph=fullgraph, sharded=sharded,
                             whole=whole)
    # whether compiling pays, measured where a step's time is the host's own: one CPU process, one micro-batch
    timed = device.type == "cpu" and not distributed and accum == 1
    opening = Opening(session, Payoff(run.stage_config.loop.log_every, run.stage_config.loop.max_steps)
                      if timed else None, install)
    layout: dict[str, Any] = dict(accum=accum, distributed=distributed, sharded=sharded)

    def eager() -> StepRunner:
        return EagerRunner(session.precision, run.module, max_grad_norm=max_grad_norm, **layout)

    def per_function(evaluate: Guarded | None = None) -> StepRunner:
        return PerFunctionRunner(session, install=opening.replace, max_grad_norm=max_grad_norm, evaluate=evaluate,
                                 **layout)

    if session.failed is not None:
        opening.inner = eager()
    elif whole:
        graphs = WholeStep(run, session.precision, max_grad_norm,
                           cache=CompileCache(session.cache_root / f"steps-{mode}", session.warn_cache),
                           max_graphs=MAX_RECOMPILES + 1, config_patches=session.recorder.options,
                           on_compile=session.whole_compiled, on_untraced=session.untraced,
                           on_full=session.whole_step_full)
        opening.inner = WholeStepRunner(session, graphs, install=opening.replace, per_function=per_function,
                                        eager=eager)
    else:
        if refused is not None:
            session.note(lambda log: log.info("step_compiled_per_function", reason=refused))
        opening.inner = per_function()
    return session, opening


class Opening:
    """The runner in front of the chosen one for a stage's first steps: it says what was noted before the run
    logged (``CompileSession.note``) and, on the CPU, times the payoff check's steps (``payoff``; the eager ones
    thrown away); then it installs the runner behind it (the one chosen, or what replaced it meanwhile)."""

    def __init__(self, session: CompileSession, payoff: Payoff | None, install: Install):
        self.session, self.payoff, self.install = session, payoff, install
        self.inner: Any = None  # the runner behind it
        self.gone = False

    def replace(self, runner: StepRunner) -> None:
        """The runner behind it is replaced (a fallback): behind it still, or where the backend calls it."""
        self.inner = runner
        if self.gone:
            self.install(runner)

    def _step_aside(self) -> None:
        self.gone = True
        self.install(self.inner)

    def evaluate(self, batch: Any) -> dict:
        self.session.log_notes()
        return self.inner.evaluate(batch)

    def train_batch(self, run: Any, batch: Any, last: bool) -> dict:
        session, payoff, inner = self.session, self.payoff, self.inner
        session.log_notes()
        if payoff is None or session.failed is not None or not hasattr(inner, "train_eagerly"):
            self._step_aside()
            return inner.train_batch(run, batch, last)
        outputs = payoff.step(run.global_step, lambda: inner.train_batch(run, batch, last), lambda: session.seconds,
                              eager=lambda: inner.train_eagerly(unobserved(run), batch),
                              aside=lambda: set_aside(run.model, run.optimizer, self._scaler_tensors()))
        found = payoff.verdict(session.seconds)
        if found is not None:
            session.not_faster(found, payoff.steps)
        if payoff.done:
            self._step_aside()
        return outputs

    def _scaler_tensors(self) -> list:
        """The loss scale's tensors, which an eager step under dynamic loss scaling updates."""
        scaler: Any = self.session.loss_scaler or self.session.scaler
        names = ("scale", "growth_tracker", "_scale", "_growth_tracker")
        return [getattr(scaler, name, None) for name in names] if scaler is not None else []
