"""``backend.compile=true`` on the CPU: the whole training step as one compiled graph, where it can be.

The static-graph tracer (``graph/tracer.py``) runs ``csframework.step.train_step`` once on fake tensors and
records one static graph of forward, loss, backward, clipping and the optimizer update (the learning rate and
the optimizer's state are graph inputs); Inductor compiles it (``graph/inductor.py``) and every step is one call
of the generated code. On the host this is the fastest mechanism measured: a small model's step is mostly
per-call overhead, which one call pays once (docs/performance.md, "Compiling the step"). The graph and its
Inductor artifact are cached under ``cache_dir()``, so an identical run loads them instead of compiling.

It applies (``refusal`` says why not) to a single-process CPU stage stepping a built-in or preinitialisable
optimizer, one micro-batch a step, and no plugin hooked inside the step (traced, such a hook would run once, not
every step). Dynamic loss scaling (``precision=float16``) is part of the graph: ``session.CompileSession`` hands over
a ``graph/precision.GraphPrecision``, whose overflow check, skipped update (``torch.where``) and new scale are
graph operations, its scale and growth tracker graph state. Otherwise, and when the step does not trace
(data-dependent code in the model), the step's functions are compiled with ``torch.compile`` instead
(``functions.PerFunctionRunner``, which ``whole_runner.WholeStepRunner`` installs in its place, once). A new
batch shape (the short last batch) compiles one more graph, reused every epoch.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from ... import step
from ...compat import needs_torch
from ...errors import CompileError, TracingError
from ...graph import optim as graph_optim
from ...graph.compiler import CompileCache, Compiled, StaticStep, numerics_key
from ...graph.inductor import STANDALONE_TORCH
from ...graph.precision import GraphLossScaler
from .findings import one_line

#: The hooks called inside a step (between the forward and the update).
IN_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


def in_step_hooks(hook_relay: Any) -> list[str]:
    """The plugins' implementations of the hooks called inside a step, as ``name (plugin p)``: ``hook_relay``
    is the plugin manager's ``pm.hook``."""
    return [f"{name} (plugin {impl.plugin_name})" for name in IN_STEP_HOOKS
            for impl in getattr(hook_relay, name).get_hookimpls()]


def refusal(*, device_type: str, distributed: bool, accum: int, optimizer: type, hooked: Iterable[str],
            repeated: str = "") -> str | None:
    """Why a stage's step is not one graph, and what would make it one (one line; then each of the step's
    functions is compiled), or ``None``: the stage's ``device_type`` (``cpu``/``cuda``), whether it is
    ``distributed`` (ddp/fsdp), its ``loop.grad_accum_steps``, its optimizer's class, the in-step hooks
    implemented (``in_step_hooks``) and, where ``backend.compile_whole_step`` is null, the model's repeated
    blocks (``regions.describe``: ``4 x Block``; empty for none)."""
    if device_type != "cpu":
        return "on a GPU the step's compiled functions run as CUDA graphs (backend.compile_mode=reduce-overhead)"
    if distributed:
        return ("under ddp and fsdp the gradients' collectives run between the step's functions "
                "(backend.strategy=single makes it one graph)")
    if accum > 1:
        return (f"loop.grad_accum_steps={accum}: each micro-batch is compiled (loop.grad_accum_steps=1 "
                "with a larger data.batch_size makes the step one graph)")
    if not graph_optim.preinitialisable(optimizer):
        return (f"optimizer {optimizer.__module__}.{optimizer.__qualname__} creates its state in its first step; "
                "give it a preinitialize() method that creates the state (torch's layout) to make the step one "
                "graph")
    hooked = list(hooked)
    if hooked:
        return (f"a plugin implements {', '.join(hooked)}, which must run at every step (traced, it would run "
                "once); move it to on_train_batch_end or on_train_step_end to make the step one graph")
    if repeated:
        return (f"the model repeats a block ({repeated}): each block is compiled once for every layer, so the first "
                "compile stays short however deep the model (backend.compile_whole_step=true traces the whole step "
                "into one graph instead: its first compile grows with the depth)")
    return needs_torch("one graph for the whole step", STANDALONE_TORCH)


class WholeStep:
    """One stage's training step as one graph per batch shape, at most ``max_graphs`` of them."""

    def __init__(self, run: Any, precision: Any, max_grad_norm: float | None, *, cache: CompileCache,
                 max_graphs: int, config_patches: dict, on_compile: Callable[[Compiled, float], Any],
                 on_untraced: Callable[[str], Any], on_full: Callable[[], Any]):
        self.run, self.precision, self.max_grad_norm = run, precision, max_grad_norm
        self.on_compile, self.on_untraced, self.on_full = on_compile, on_untraced, on_full
        scaler = getattr(precision, "scaler", None)  # in-graph loss scaling: its tensors are the graph's state
        extras = scaler.state_attrs() if isinstance(scaler, GraphLossScaler) else []
        self.graphs = StaticStep(self._step, "train_step", retrace=False, cache=cache, keyed=True,
                                 modules=[run.model], optimizers=[run.optimizer], extras=extras,
                                 graph_compiler="inductor", max_graphs=max_graphs, config_patches=config_patches,
                                 on_compile=self._compiled, key=numerics_key(run.stage_config.precision))
        self.full = False  # max_graphs reached: batches of other shapes run eagerly
        #: why the step is not one graph after all, once ``__call__`` returned ``None``: ``("trace", reason)``
        #: when its first trace failed (its functions compile instead), ``("compile", reason)`` when Inductor
        #: could not compile it (the run goes on eagerly)
        self.refused: tuple[str, str] | None = None
        self._started = 0.0

    def _step(self, batch: Any, run: Any = None) -> dict:
        run = self.run if run is None else run
        return step.train_step(run, self.precision, run.module, [batch], self.max_grad_norm)

    def _compiled(self, compiled: Compiled) -> None:
        info = compiled.report.get("graph_compiler", {})
        if info.get("status") == "fallback":
            self.refused = ("compile", str(info.get("reason", "unknown")))
        else:
            self.on_compile(compiled, time.perf_counter() - self._started)

    @property
    def traced(self) -> bool:
        """Whether the step has traced into a graph at least once."""
        return self.graphs.first is not None

    def __call__(self, batch: Any, global_step: int) -> dict | None:
        """Train on ``batch``: its graph (traced and compiled first if its shape is new), or eagerly once
        ``max_graphs`` are compiled and its shape is not one of them, or when a later shape does not trace
        (``on_untraced`` is told why). ``None`` when the step is not one graph after all (``refused`` says why):
        nothing has changed then, and the caller runs the step another way."""
        self._started = time.perf_counter()
        try:
            prepared = self.graphs.prepare((batch,), {}, iteration=global_step + 1)
        except (TracingError, CompileError) as e:  # the tracer's refusal: data-dependent code, a dynamic shape
            if not self.traced:
                self.refused = ("trace", one_line(e))
                return None
            self.on_untraced(one_line(e))
            return self.eager(batch)
        if self.refused is not None:
            return None
        if prepared is None:
            if not self.full:
                self.full = True
                self.on_full()
            return self.eager(batch)
        return self.graphs.execute(prepared, global_step)

    def eager(self, batch: Any, run: Any = None) -> dict:
        """The same step without a graph (of ``run``, a stand-in for the run: the payoff check's)."""
        return self._step(batch, run)


def batch_shapes(compiled: Compiled) -> tuple:
    """The shapes and dtypes of the batch a graph was traced for."""
    traced = compiled.traced
    return tuple((tuple(traced.arg_leaves[i].shape), str(traced.arg_leaves[i].dtype).replace("torch.", ""))
                 for i in traced.arg_positions)
