"""Capture a step function into a static graph, and run that graph every iteration.

How a step is traced (see docs/design/csx-emulator.md for why this route):

1. The *state* the step reads and updates (parameters and buffers of the compiled modules, the optimizers'
   state tensors, loss-scaling tensors) is collected from the live objects, plus the *feeds* (one learning
   rate per optimizer param group and the global step) and the tensors among the step's arguments.
2. ``torch.fx.experimental.proxy_tensor.make_fx(tracing_mode="fake")`` runs the Python step once on fake
   tensors that stand in for all of them: while it runs, the modules' parameters/buffers, the optimizers'
   ``param_groups``/``state`` and learning rates are swapped for the fakes, so ordinary eager code
   (``model(x)``, ``loss.backward()``, ``optimizer.step()``, ``zero_grad()``) is recorded operation by
   operation, forward and backward, at the ATen level. No real data is read; Python runs exactly once.
3. A ``TorchFunctionMode`` guards the trace: reading a value (``bool(t)``, ``.item()``, ``.tolist()``,
   ``.cpu()``...) raises ``TracingError`` naming the user's line; step closures and the compiled-model rule
   are recorded on the active ``TraceContext``.
4. Updates of state are in-place operations on the graph's inputs (torch's own style), or, where the code
   rebinds a buffer or a state entry, an extra output written back after each execution.

Every execution then calls the graph with the real tensors with autograd off (the backward pass is already in
the graph), runs the step closures with their values, and returns the outputs (``execution.py``: copies of
those that share memory with the state).

5. While the step runs, ``replay.OpRecorder`` writes down the ATen operation stream above ``make_fx``. A retrace
   (``retrace_every_iteration``) runs the same Python again without building a graph and compares streams:
   ``replay`` on fake tensors, or ``run_checked`` on the live tensors (an interpreted graph: each operation is
   checked before it runs, so the step is the graph's execution).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..compat import TORCH
from ..errors import CompileError, TracingError
from . import optim as graph_optim
from .replay import CheckingRecorder, Diverged, OpRecorder, Recording, finish
from .watch import StateWatch, walk
from .errors import Where, called_from, first_refusal, translate, tracing_error, user_frame_here, user_location

# -- the active trace ---------------------------------------------------------------------------------------

_ACTIVE: "TraceContext | None" = None


def active() -> "TraceContext | None":
    """The trace in progress, if any (step closures and compiled models register with it)."""
    return _ACTIVE


@dataclass
class Closure:
    fn: Callable
    spec: Any
    leaves: list
    positions: list[int]  # leaves that are graph outputs: (leaf index)


@dataclass
class TraceContext:
    name: str
    closures: list[Closure] = field(default_factory=list)
    closure_tensors: list[torch.Tensor] = field(default_factory=list)
    model: Any = None
    global_step: torch.Tensor | None = None

    def add_closure(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                positions.append(i)
                self.closure_tensors.append(leaf.detach())
        self.closures.append(Closure(fn, spec, leaves, positions))

    def use_model(self, model) -> None:
        """Only one compiled model may run in a step."""
        if self.model is not None and self.model is not model:
            where = user_frame_here(2)
            raise CompileError(
                f"only one compiled model per step: '{self.name}' runs {_model_name(self.model)} and "
                f"{_model_name(model)}" + (f" (the second at {where})" if where else "") +
                "; a CSX system runs one compiled model per step: put both in one nn.Module and "
                "csf.compile that")
        self.model = model


def _model_name(model) -> str:
    inner = getattr(model, "model", model)
    return f"{type(inner).__name__} (compiled model #{getattr(model, 'index', '?')})"


# -- guards -------------------------------------------------------------------------------------------------

T = torch.Tensor
_READS = {T.__bool__: "bool", T.item: "item", T.tolist: "tolist", T.__int__: "number", T.__float__: "number",
          T.__index__: "number", T.__complex__: "number", T.numpy: "numpy", T.cpu: "cpu"}
if hasattr(T, "__array__"):
    _READS[T.__array__] = "numpy"
_TEXT = {T.__repr__, T.__str__}


def _is_host(device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0].strip().lower() == "cpu"
    return False


class GuardMode(TorchFunctionMode):
    """Refuses reads of tensor values during the trace, naming the user's line, and tags the graph nodes
    each user-level torch call creates with that call's place (``node.meta["csf_where"]``)."""

    def __init__(self, graph=None, recorder=None):
        super().__init__()
        self.graph = graph
        self.recorder = recorder  # replay.OpRecorder: told the user's line of each torch call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recorder is not None and not self.recorder.where_on_difference:
            self.recorder.where = user_location(1)
        kind = _READS.get(func)
        if kind is not None:
            if kind == "item" and called_from("tolist"):
                kind = "tolist"
            raise tracing_error(kind, user_frame_here(2))
        if func is T.to and (any(_is_host(a) for a in args[1:]) or _is_host(kwargs.get("device"))):
            raise tracing_error("cpu", user_frame_here(2))
        if func in _TEXT and args and isinstance(args[0], T):
            t = args[0]
            return f"TracedTensor(shape={tuple(t.shape)}, dtype={t.dtype})"
        if func is T.__format__ and args and isinstance(args[0], T):
            if len(args) > 1 and args[1]:
                raise tracing_error("format", user_frame_here(2))
            t = args[0]
            return f"TracedTensor(shape={tuple(t.shape)}, dtype={t.dtype})"
        graph = self.graph
        if graph is None:
            return func(*args, **kwargs)
        before = len(graph.nodes)
        out = func(*args, **kwargs)
        added = len(graph.nodes) - before
        if added > 0:
            where = user_location(1)
            for node in reversed(graph.nodes):
                if added <= 0:
                    break
                node.meta.setdefault("csf_where", where)
                added -= 1
        return out


# -- state ---------------------------------------------------------------------------------------------------

class GuardedDict(dict):
    """An optimizer's per-parameter state during the trace: existing entries may be updated (or rebound),
    new entries may not be created."""

    owner = "optimizer"

    def __setitem__(self, key, value):
        if key not in self:
            raise TracingError(
                f"{self.owner} creates state '{key}' inside the traced step"
                + (f" at {user_frame_here(2)}" if user_frame_here(2) else "")
                + ": state created during the step has no place to live between steps (it would be "
                "re-created every step). Fix: create it before the trace: give the optimizer a "
                "`preinitialize()` method that fills self.state[p] for every parameter (it is called before "
                "tracing), or use torch.optim.SGD/Adam/AdamW, which are preinitialized for you.")
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


class GuardedState(dict):
    """``optimizer.state`` during the trace: a missing parameter entry is state created in the step."""

    owner = "optimizer"

    def __missing__(self, key):
        entry = GuardedDict()
        entry.owner = self.owner
        return entry  # not stored: writing into it raises


@dataclass
class Slot:
    container: Any  # a dict (module._parameters / _buffers, optimizer state) or an object (attribute)
    key: Any
    position: int
    kind: str

    def get(self):
        return self.container[self.key] if isinstance(self.container, dict) else getattr(self.container, self.key)

    def set(self, value):
        if isinstance(self.container, dict):
            dict.__setitem__(self.container, self.key, value)
        else:
            setattr(self.container, self.key, value)


@dataclass
class State:
    """The live tensors a step reads and updates, in graph-input order."""
    tensors: list[torch.Tensor]
    kinds: list[str]
    names: list[str]
    slots: list[Slot]
    optimizers: list
    lrs: list[float]
    hyper: tuple
    layout: tuple


def collect_state(modules: Sequence[torch.nn.Module], optimizers: Sequence, extras: Sequence[tuple]) -> State:
    tensors: list[torch.Tensor] = []
    kinds: list[str] = []
    names: list[str] = []
    slots: list[Slot] = []
    index: dict[int, int] = {}

    def add(t, kind, name):
        pos = index.get(id(t))
        if pos is None:
            pos = index[id(t)] = len(tensors)
            tensors.append(t)
            kinds.append(kind)
            names.append(name)
        return pos

    for m_i, module in enumerate(modules):
        prefix = f"model{m_i}." if len(modules) > 1 else ""
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            dot = f"{mod_name}." if mod_name else ""
            for name, p in mod._parameters.items():
                if p is not None:
                    slots.append(Slot(mod._parameters, name, add(p, "parameter", prefix + dot + name), "parameter"))
            for name, b in mod._buffers.items():
                if b is not None:
                    slots.append(Slot(mod._buffers, name, add(b, "buffer", prefix + dot + name), "buffer"))
    lrs: list[float] = []
    hyper: list[tuple] = []
    for o_i, opt in enumerate(optimizers):
        for g_i, group in enumerate(opt.param_groups):
            lrs.append(float(group["lr"]))
            hyper.append(tuple(sorted((k, _freeze(v)) for k, v in group.items() if k not in ("params", "lr"))))
            for p_i, p in enumerate(group["params"]):
                add(p, "parameter", f"optimizer{o_i}.group{g_i}.param{p_i}")
        for p_i, (p, st) in enumerate(opt.state.items()):
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    pos = add(value, "optimizer_state", f"optimizer{o_i}.state{p_i}.{key}")
                    slots.append(Slot(st, key, pos, "optimizer_state"))
                else:
                    hyper.append((o_i, p_i, key, _freeze(value)))
    for obj, attr, kind in extras:
        t = getattr(obj, attr)
        slots.append(Slot(obj, attr, add(t, kind, f"{kind}.{attr}"), kind))
    layout = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in tensors)
    return State(tensors, kinds, names, slots, list(optimizers), lrs, tuple(hyper), layout)


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return repr(value)


class _Swap:
    """Puts the fakes in place of the live state for the duration of the trace, then restores it."""

    def __init__(self, state: State, fakes: Sequence[torch.Tensor], lr_fakes: Sequence[torch.Tensor]):
        self.state, self.fakes, self.lr_fakes = state, list(fakes), list(lr_fakes)
        self.undo: list[Callable[[], None]] = []
        self.fake_state: list[tuple[Any, Any, dict[int, dict]]] = []

    def __enter__(self):
        try:
            self._enter()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _enter(self):
        state, fakes = self.state, self.fakes
        fake_of = {id(t): fakes[i] for i, t in enumerate(state.tensors)}
        for slot in state.slots:
            if slot.kind == "optimizer_state":
                continue
            old = slot.get()
            slot.set(fakes[slot.position])
            self.undo.append(functools.partial(slot.set, old))
        for i, kind in enumerate(state.kinds):
            if kind == "parameter":
                fakes[i].grad = None
        lr_iter = iter(self.lr_fakes)
        for opt in state.optimizers:
            groups = [(g, g["params"], g["lr"]) for g in opt.param_groups]
            for group in opt.param_groups:
                group["params"] = [fake_of[id(p)] for p in group["params"]]
                group["lr"] = next(lr_iter)
            self.undo.append(functools.partial(_restore_groups, groups))
            real_state = opt.state
            guarded = GuardedState()
            guarded.owner = f"optimizer {type(opt).__name__}"
            per_param = {}
            for p, st in real_state.items():
                entry = GuardedDict()
                entry.owner = guarded.owner
                for key, value in st.items():
                    dict.__setitem__(entry, key, fake_of[id(value)] if isinstance(value, torch.Tensor) else value)
                dict.__setitem__(guarded, fake_of[id(p)], entry)
                per_param[id(p)] = entry
            self.fake_state.append((opt, real_state, per_param))
            opt.state = guarded
            self.undo.append(functools.partial(setattr, opt, "state", real_state))
            if graph_optim.is_builtin(opt):
                had = "step" in opt.__dict__
                previous = opt.__dict__.get("step")
                opt.step = functools.partial(_builtin_step, opt)
                self.undo.append(functools.partial(_restore_step, opt, had, previous))

    def writebacks(self) -> list[tuple[int, torch.Tensor]]:
        """State the step rebound instead of updating in place: (input position, new value)."""
        found = []
        for slot in self.state.slots:
            if slot.kind == "optimizer_state":
                continue
            current = slot.get()
            if current is not self.fakes[slot.position]:
                if slot.kind == "parameter" or not isinstance(current, torch.Tensor):
                    raise CompileError(f"the traced step replaced {slot.kind} '{slot.key}' with "
                                       f"{type(current).__name__}; update it in place (e.g. with copy_) instead")
                found.append((slot.position, current.detach()))
        positions = {id(t): i for i, t in enumerate(self.state.tensors)}
        for opt, real_state, per_param in self.fake_state:
            for p, st in real_state.items():
                entry = per_param[id(p)]
                for key, value in st.items():
                    now = dict.get(entry, key)
                    if isinstance(value, torch.Tensor):
                        pos = positions[id(value)]
                        if now is self.fakes[pos]:
                            continue
                        if not isinstance(now, torch.Tensor):
                            raise TracingError(f"optimizer {type(opt).__name__} replaced its state '{key}' with a "
                                               "Python value inside the traced step; keep it a tensor and update "
                                               "it with tensor operations")
                        found.append((pos, now.detach()))
                    elif now is not value and now != value:
                        raise TracingError(
                            f"optimizer {type(opt).__name__} changes its state '{key}' (a Python "
                            f"{type(value).__name__}) inside the traced step: Python values change only when the "
                            "step is traced, not every step. Fix: make it a tensor (e.g. "
                            f"torch.tensor({value!r}) in preinitialize()) and update it with tensor operations.")
        return found

    def __exit__(self, *exc):
        while self.undo:
            self.undo.pop()()
        return False


def _restore_groups(groups) -> None:
    for group, params, lr in groups:
        group["params"] = params
        group["lr"] = lr


def _restore_step(opt, had: bool, previous) -> None:
    if had:
        opt.step = previous
    else:
        opt.__dict__.pop("step", None)


def _builtin_step(opt, closure=None):
    if closure is not None:
        raise TracingError(f"{type(opt).__name__}.step(closure): a closure that re-evaluates the model "
                           "cannot be part of a static graph; call step() without one")
    graph_optim.step(opt)


def _refuse_dynamic_shapes(gm) -> None:
    """Operations whose output shape depends on tensor values (boolean indexing, nonzero, unique) cannot be
    in a static graph; fake tracing records them with symbolic sizes, which are refused here."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        dynamic = "unbacked_bindings" in node.meta or any(
            isinstance(v, torch.Tensor) and any(not isinstance(d, int) for d in v.shape) for v in vals)
        if dynamic:
            loc = node.meta.get("csf_where")
            raise tracing_error("shape", Where(*loc) if loc else None, f"operation {node.target}")


def _unknown_optimizer_hook(known):
    def hook(optimizer, args, kwargs):
        if not any(optimizer is k for k in known):
            where = user_frame_here(2)
            raise TracingError(
                f"optimizer {type(optimizer).__name__} is stepped inside the traced step"
                + (f" at {where}" if where else "") + " but the CSX backend does not know it, so its state "
                "cannot be part of the graph. Fix: refer to it by a global or enclosing variable in the traced "
                "function, or call backend.register_optimizer(optimizer) before the first step.")
    return hook


# -- traced steps -------------------------------------------------------------------------------------------

@dataclass
class Traced:
    """One trace of a step: the graph and how to map its inputs and outputs."""
    gm: torch.fx.GraphModule
    state: State
    arg_positions: list[int]
    arg_leaves: list
    arg_spec: Any
    out_spec: Any
    out_leaves: list           # non-tensor leaves as traced; tensor leaves replaced by None
    out_tensor_positions: list[int]
    closures: list[Closure]
    n_closure_tensors: int
    writebacks: list[int]      # input positions written back after each execution
    seconds: float
    recording: Recording | None = None  # the operation stream (what retraces replay and compare); None: a
    # higher-order operator hid part of it, and every retrace is a whole trace
    fresh: tuple[bool, ...] | None = None  # passes.fresh_outputs of the graph, once it is final


@dataclass
class Signature:
    """What a graph is specialised on; compared at every execution when not retracing."""
    values: tuple
    labels: tuple


def _describe(value) -> str:
    if isinstance(value, tuple) and len(value) == 4 and isinstance(value[1], torch.dtype):
        return f"shape {list(value[0])} {str(value[1]).replace('torch.', '')}"
    return repr(value)


def _arg_meta(leaf):
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    return ("python", _freeze(leaf))


_SIGNATURE_LABELS = ("state tensors (parameters, buffers, optimizer state)",
                     "optimizer settings (other than the learning rate) and Python optimizer state",
                     "train/eval mode of the compiled modules", "the step's arguments")


def signature(state: State, modules, leaves, flags: tuple | None = None) -> Signature:
    """What a graph traced now would be specialised on; ``flags``: the modules' train/eval modes, if known."""
    if flags is None:
        flags = tuple(m.training for module in modules for m in walk(module, []))
    return Signature((state.layout, state.hyper, flags, tuple(map(_arg_meta, leaves))), _SIGNATURE_LABELS)


def detailed_difference(old: Signature, new: Signature, state: State) -> str:
    """The first difference between two signatures, down to the tensor or argument."""
    o_layout, o_hyper, o_flags, o_args = old.values
    n_layout, n_hyper, n_flags, n_args = new.values
    if o_args != n_args:
        for i, (a, b) in enumerate(zip(o_args, n_args)):
            if a != b:
                return f"argument {i} of the step: {_describe(a)} when traced, {_describe(b)} now"
        return f"the step's arguments: {len(o_args)} leaves when traced, {len(n_args)} now"
    if o_layout != n_layout:
        for i, (a, b) in enumerate(zip(o_layout, n_layout)):
            if a != b:
                name = state.names[i] if i < len(state.names) else f"#{i}"
                if a[:3] == b[:3]:  # only requires_grad (a parameter frozen or unfrozen)
                    return f"state tensor {name}: requires_grad {a[3]} when traced, {b[3]} now"
                return f"state tensor {name}: {_describe(a)} when traced, {_describe(b)} now"
        return f"the number of state tensors changed from {len(o_layout)} to {len(n_layout)}"
    if o_hyper != n_hyper:
        for a, b in zip(o_hyper, n_hyper):
            if a != b:
                return f"optimizer setting {b!r} was {a!r} when traced"
        return "the optimizer settings changed"
    if o_flags != n_flags:
        return "the train/eval mode of the compiled modules changed (call model.train()/eval() consistently)"
    return "unknown difference"


class StepTracer:
    """Traces ``fn`` over the given modules/optimizers/extra state and executes the resulting graph."""

    def __init__(self, fn: Callable, name: str, *, modules=(), optimizers=(), extras=(),
                 compute_context: Callable[[], Any] | None = None, record: bool = True):
        self.fn, self.name = fn, name
        # keep each trace's operation stream (what retraces compare with); before torch 2.5 a dispatch mode
        # cannot let a higher-order operator (torch.cond) pass, so there every retrace is a whole trace
        self.record = record and TORCH >= (2, 5)
        self.modules, self.optimizers, self.extras = list(modules), list(optimizers), list(extras)
        self._user_preinitialized = [opt for opt in self.optimizers if not graph_optim.is_builtin(opt)]
        self._cached: tuple[StateWatch, State, Signature, Callable] | None = None
        self.compute_context = compute_context or contextlib.nullcontext

    # -- state ------------------------------------------------------------------------------------------
    def collect(self, leaves) -> tuple[State, Signature]:
        """The live state and the signature of this call. The full collection (names, slots, layout) is
        redone only when something it depends on changed (``watch.StateWatch``)."""
        for opt in self._user_preinitialized:  # the user's own ``preinitialize()``: called at every step
            graph_optim.preinitialize(opt)
        cached = self._cached
        if cached is not None and cached[3](leaves):  # the state and the arguments' layout of the last call
            cached[1].lrs = cached[0].lrs()
            return cached[1], cached[2]
        if cached is not None and (watch := cached[0]).unchanged():
            state = cached[1]
        else:
            # the built-in optimizers' state is created if missing (it is, unchanged, when the watch holds)
            for opt in self.optimizers:
                graph_optim.preinitialize(opt)
            state = collect_state(self.modules, self.optimizers, self.extras)
            watch = StateWatch(self.modules, self.optimizers, self.extras, state.tensors)
        state.lrs = watch.lrs()
        sig = signature(state, self.modules, leaves, watch.flags)
        self._cached = (watch, state, sig, watch.check(leaves))
        return state, sig

    # -- tracing ----------------------------------------------------------------------------------------
    def trace(self, args: tuple, kwargs: dict, state: State) -> Traced:
        """Run the step once on fake tensors and return its graph (Python side effects happen now)."""
        from torch.fx.experimental.proxy_tensor import make_fx

        from ..compat import get_proxy_mode, make_fx_options

        leaves, spec = pytree.tree_flatten((args, kwargs))
        arg_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        ctx = TraceContext(self.name)
        result: dict[str, Any] = {}

        def flat_fn(*inputs):
            proxy_mode = get_proxy_mode()
            return self._run(inputs, leaves, spec, arg_positions, state, ctx, result,
                             proxy_mode.tracer.graph if proxy_mode is not None else None,
                             OpRecorder(inputs) if self.record else None)

        inputs = _inputs(state, leaves, arg_positions)
        start = time.perf_counter()
        with self._tracing(ctx):
            gm = make_fx(flat_fn, tracing_mode="fake", _allow_non_fake_inputs=True, **make_fx_options())(*inputs)
            _refuse_dynamic_shapes(gm)
        return Traced(gm=gm, state=state, arg_positions=arg_positions, arg_leaves=leaves, arg_spec=spec,
                      out_spec=result["out_spec"], out_leaves=result["out_leaves"],
                      out_tensor_positions=result["tensor_positions"], closures=ctx.closures,
                      n_closure_tensors=len(ctx.closure_tensors), writebacks=result["writebacks"],
                      seconds=time.perf_counter() - start,
                      recording=result["recording"] if self.record and not result["recording"].opaque else None)

    def replay(self, args: tuple, kwargs: dict, state: State) -> Recording:
        """Run the step's Python again as ``trace`` does, on fake tensors, but record only its operation stream
        (``replay.OpRecorder``) instead of building a graph: the retrace of ``retrace_every_iteration``, which
        compares the stream with the first trace's (Python side effects happen now)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import disable_autocast_cache
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        leaves, spec = pytree.tree_flatten((args, kwargs))
        arg_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        ctx = TraceContext(self.name)
        result: dict[str, Any] = {}
        start = time.perf_counter()
        # the fake-tensor mode make_fx(tracing_mode="fake") makes, so that the step's Python sees the same tensors
        mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=ShapeEnv(),
                              static_shapes=True)
        with self._tracing(ctx):
            fakes = [mode.from_tensor(t) for t in _inputs(state, leaves, arg_positions)]
            with mode, disable_autocast_cache():
                self._run(fakes, leaves, spec, arg_positions, state, ctx, result, None, OpRecorder(fakes))
        recording: Recording = result["recording"]
        recording.closures = ctx.closures
        recording.out_spec, recording.out_leaves = result["out_spec"], result["out_leaves"]
        recording.out_tensor_positions = result["tensor_positions"]
        recording.seconds = time.perf_counter() - start
        return recording

    def _run(self, inputs, leaves, spec, arg_positions, state: State, ctx: TraceContext, result: dict, graph,
             recorder: OpRecorder | None):
        """The step's Python on the fake ``inputs`` (state, learning rates, global step, the step's tensor
        arguments), with the state swapped for them and ``OpRecorder`` writing down the operations (under
        make_fx, above its graph-building mode); returns the graph's outputs and fills ``result``."""
        n_state, n_lr = len(state.tensors), len(state.lrs)
        fakes = list(inputs[:n_state])
        lr_fakes = inputs[n_state:n_state + n_lr]
        ctx.global_step = inputs[n_state + n_lr]
        new_leaves = list(leaves)
        for pos, fake in zip(arg_positions, inputs[n_state + n_lr + 1:]):
            new_leaves[pos] = fake
        call_args, call_kwargs = pytree.tree_unflatten(new_leaves, spec)
        with recorder if recorder is not None else contextlib.nullcontext():
            with _Swap(state, fakes, lr_fakes) as swap:
                with GuardMode(graph, recorder), self.compute_context():
                    out = self.fn(*call_args, **call_kwargs)
                writebacks = swap.writebacks()
            out_leaves, out_spec = pytree.tree_flatten(out)
            tensor_positions = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
            outs = [out_leaves[i].detach() for i in tensor_positions]
        result.update(out_spec=out_spec, tensor_positions=tensor_positions, writebacks=[p for p, _ in writebacks],
                      out_leaves=[None if isinstance(x, torch.Tensor) else x for x in out_leaves],
                      recording=finish(recorder, outs, ctx.closure_tensors, writebacks) if recorder is not None else None)
        return outs + list(ctx.closure_tensors) + [v for _, v in writebacks]

    @contextlib.contextmanager
    def _tracing(self, ctx: TraceContext):
        """What surrounds a trace: the active trace context, the unknown-optimizer hook, the grad mode, and
        torch's errors translated into the emulator's (naming the user's line)."""
        global _ACTIVE
        hook = register_optimizer_step_pre_hook(_unknown_optimizer_hook(self.optimizers))
        previous, _ACTIVE = _ACTIVE, ctx
        collecting = gc.isenabled()
        gc.disable()  # a trace allocates many small objects: the collections they set off scan the whole heap
        try:
            # outside inference mode (evaluation runs under it), keeping the caller's grad mode: torch 2.4's fake
            # tensors cannot take some views of inference tensors ("Cannot set version_counter for inference
            # tensor"); the graph is the same, and it still executes under the caller's mode
            grad = torch.is_grad_enabled()  # read first: leaving inference mode enables grad mode
            with torch.inference_mode(False), torch.set_grad_enabled(grad), _fake_tensors_take_foreach():
                yield
        except (TracingError, CompileError):
            raise
        except Exception as e:
            translated = translate(e)
            if translated is not None:
                raise translated from e
            raise
        finally:
            _ACTIVE = previous
            hook.remove()
            if collecting:
                gc.enable()

    # -- execution (the steady state: execution.Execution) ------------------------------------------------
    def run_checked(self, args: tuple, kwargs: dict, state: State, expected: Recording, global_step: int):
        """Run the step's Python on the live tensors, each operation checked against the first trace's stream
        (``expected``) before it runs (``replay.CheckingRecorder``): the retrace and the execution of an
        interpreted graph in one. Writes the rebound state back and returns the recording and copies of the step's
        outputs and closure values (for ``execution.deliver``); raises ``Diverged`` at the first difference, the
        state written so far put back."""
        from torch.fx.experimental.proxy_tensor import disable_autocast_cache

        leaves, spec = pytree.tree_flatten((args, kwargs))
        arg_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        ctx = TraceContext(self.name)
        result: dict[str, Any] = {}
        inputs = _inputs(state, leaves, arg_positions, global_step)
        recorder = CheckingRecorder(inputs, len(state.tensors), expected)
        try:
            with self._tracing(ctx), disable_autocast_cache():  # make_fx's autocast setting: the same casts
                outs = self._run(inputs, leaves, spec, arg_positions, state, ctx, result, None, recorder)
            recording = result["recording"]
            difference = recording.first_difference(expected)
            if difference is not None:  # the same operations, but other results (returned, written back)
                recorder.diverged = difference
                raise Diverged(difference)
        except BaseException as e:
            # the step stops, as a step that failed to trace: the state it wrote into is put back
            recorder.restore()
            for t, kind in zip(state.tensors, state.kinds):
                if kind == "parameter":
                    t.grad = None
            if recorder.diverged is None:
                raise
            cause = first_refusal(e)  # an error that unwinding through a differing operation (a profiler
            if cause is not None:      # range's exit) would hide
                raise cause from None
            raise Diverged(recorder.diverged) from None
        recording.closures = ctx.closures
        recording.out_spec, recording.out_leaves = result["out_spec"], result["out_leaves"]
        recording.out_tensor_positions = result["tensor_positions"]
        n_results = len(recording.out_tensor_positions) + len(ctx.closure_tensors)
        with torch.no_grad():  # (a copy made here needs no ``detach``)
            for pos, value in zip(result["writebacks"], outs[n_results:]):
                state.tensors[pos].copy_(value)
            return recording, [t.clone() for t in outs[:n_results]]


@contextlib.contextmanager
def _fake_tensors_take_foreach():
    """torch chooses its foreach kernels (``clip_grad_norm_``, an optimizer's ``foreach=None``) by the exact
    type of the tensors, which a fake tensor fails: it is added to torch's lists of those types (as torch adds
    ``DTensor``) while a step is traced, so the trace takes the kernels the live step takes."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils
    from torch._subclasses.fake_tensor import FakeTensor

    lists = [getattr(module, "_foreach_supported_types", None) for module in (optimizer, _foreach_utils)]
    added = [types for types in lists if isinstance(types, list) and FakeTensor not in types]
    for types in added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        for types in added:
            types.remove(FakeTensor)


def _inputs(state: State, leaves: list, arg_positions: list[int], global_step: int = 0) -> list:
    """A graph's inputs, in order: the state tensors, one learning rate per param group, the global step and
    the step's tensor arguments (a step's execution keeps its own: ``execution.Execution``)."""
    feeds = [*(torch.tensor(lr, dtype=torch.float64) for lr in state.lrs),
             torch.tensor(global_step, dtype=torch.int64)]
    return [*state.tensors, *feeds, *map(leaves.__getitem__, arg_positions)]


def step_closure(fn: Callable) -> Callable:
    """Decorator: inside a traced step, calling ``fn(...)`` schedules it to run after each executed step with
    that step's values (detached copies of the tensor arguments); outside a trace (eager CPU/GPU) it runs at
    once, with detached copies too, so the same code behaves the same on every device."""

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        ctx = _ACTIVE
        if ctx is None:
            args, kwargs = pytree.tree_map(
                lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
            return fn(*args, **kwargs)
        ctx.add_closure(fn, args, kwargs)
        return None

    setattr(closure, "__csf_step_closure__", True)  # noqa: B010 - marks the wrapper (functools' type has no slot)
    return closure
