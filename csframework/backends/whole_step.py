"""``backend.compile=true`` on the CPU: the whole training step as one compiled graph, where it can be.

The CSX emulator's tracer (``csx/tracer.py``) runs ``csframework.step.train_step`` once on fake tensors and
records one static graph of forward, loss, backward, clipping and the optimizer update (the learning rate and
the optimizer's state are graph inputs); Inductor compiles it (``csx/inductor.py``) and every step is one call
of the generated code. On the host this is the fastest mechanism measured: a small model's step is mostly
per-call overhead, which one call pays once (docs/performance.md, "Compiling the step"). The graph and its
Inductor artifact are cached under ``cache_dir()``, so an identical run loads them instead of compiling.

It applies (``unavailable`` says why not) to a single-process CPU stage stepping a built-in or preinitialisable
optimizer, one micro-batch a step, and no plugin hooked inside the step (traced, such a hook would run once, not
every step), to a model without repeated blocks (one graph would compile every layer again: ``regions`` compiles
each block once instead). Dynamic loss scaling (``precision=float16``) is part of the graph, as on CSX: ``CompiledStep``
hands over ``csx/precision.CsxPrecision``, whose overflow check, skipped update (``torch.where``) and new scale
are graph operations, its scale and growth tracker graph state. Otherwise, and when the step does not trace
(data-dependent code in the model), ``compiled.CompiledStep`` compiles the step's functions with
``torch.compile`` instead. A new batch shape (the short last batch) compiles one more graph, reused every epoch.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from .. import step
from ..compat import needs_torch
from ..errors import CompileError, TracingError
from . import regions
from .csx import optim as csx_optim
from .csx.compiler import CompileCache, Compiled, GraphLimitError, StaticStep, numerics_key
from .csx.inductor import STANDALONE_TORCH
from .csx.precision import GraphLossScaler

if TYPE_CHECKING:
    from .eager import EagerBackend

#: The hooks called inside a step (between the forward and the update).
IN_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


def unavailable(run, backend: EagerBackend) -> str | None:
    """Why this stage's step cannot be one graph, and what would make it one (one line; then each of the step's
    functions is compiled), or ``None``."""
    if backend.device.type != "cpu":
        return "on a GPU the step's compiled functions run as CUDA graphs (backend.compile_mode=reduce-overhead)"
    if backend.distributed:
        return ("under ddp and fsdp the gradients' collectives run between the step's functions "
                "(backend.strategy=single makes it one graph)")
    if backend.accum > 1:
        return (f"loop.grad_accum_steps={backend.accum}: each micro-batch is compiled (loop.grad_accum_steps=1 "
                "with a larger data.batch_size makes the step one graph)")
    optimizer = type(run.optimizer)
    if not csx_optim.preinitialisable(optimizer):
        return (f"optimizer {optimizer.__module__}.{optimizer.__qualname__} creates its state in its first step; "
                "give it a preinitialize() method that creates the state (torch's layout) to make the step one "
                "graph")
    hooked = [f"{name} (plugin {impl.plugin_name})" for name in IN_STEP_HOOKS
              for impl in getattr(run.hooks.pm.hook, name).get_hookimpls()]
    if hooked:
        return (f"a plugin implements {', '.join(hooked)}, which must run at every step (traced, it would run "
                "once); move it to on_train_batch_end or on_train_step_end to make the step one graph")
    return needs_torch("one graph for the whole step", STANDALONE_TORCH) or regions.whole_step_refusal(run.module)


class WholeStep:
    """One stage's training step as one graph per batch shape, at most ``max_graphs`` of them."""

    def __init__(self, run, precision, max_grad_norm: float | None, *, cache: CompileCache, max_graphs: int,
                 config_patches: dict, on_compile: Callable[[Compiled, float], Any]):
        self.run, self.precision, self.max_grad_norm = run, precision, max_grad_norm
        self.on_compile = on_compile
        scaler = getattr(precision, "scaler", None)  # in-graph loss scaling: its tensors are the graph's state
        extras = scaler.state_attrs() if isinstance(scaler, GraphLossScaler) else []
        self.graphs = StaticStep(self._step, "train_step", retrace=False, cache=cache, keyed=True,
                                 modules=[run.model], optimizers=[run.optimizer], extras=extras,
                                 graph_compiler="inductor", max_graphs=max_graphs, config_patches=config_patches,
                                 on_compile=self._compiled, key=numerics_key(run.stage_config.precision))
        self.full = False  # max_graphs reached: batches of other shapes run eagerly
        self._started = 0.0

    def _step(self, batch) -> dict:
        return step.train_step(self.run, self.precision, self.run.module, [batch], self.max_grad_norm)

    def _compiled(self, compiled: Compiled) -> None:
        self.on_compile(compiled, time.perf_counter() - self._started)

    @property
    def traced(self) -> bool:
        """Whether the step has traced into a graph at least once."""
        return self.graphs.first is not None

    def __call__(self, batch, global_step: int) -> dict:
        """Train on ``batch``: its graph (traced and compiled first if its shape is new), or eagerly once
        ``max_graphs`` are compiled and its shape is not one of them. Raises ``TracingError`` or
        ``CompileError`` when the first trace fails (nothing has changed then)."""
        self._started = time.perf_counter()
        try:
            return self.graphs((batch,), {}, iteration=global_step + 1, global_step=global_step)
        except GraphLimitError:
            self.full = True
            return self.eager(batch)

    def eager(self, batch) -> dict:
        """The same step without a graph."""
        return self._step(batch)


def first_trace_failed(error: BaseException) -> bool:
    """Whether ``error`` is the tracer's refusal of the step (data-dependent code, a dynamic shape)."""
    return isinstance(error, (TracingError, CompileError)) and not isinstance(error, GraphLimitError)


def batch_shapes(compiled: Compiled) -> tuple:
    """The shapes and dtypes of the batch a graph was traced for."""
    traced = compiled.traced
    return tuple((tuple(traced.arg_leaves[i].shape), str(traced.arg_leaves[i].dtype).replace("torch.", ""))
                 for i in traced.arg_positions)

