"""The low-level API for custom training loops, mirroring ``cerebras.pytorch``:

    import csframework as csf

    backend = csf.backend("CSX", retrace_every_iteration=False)   # or "CPU" / "GPU": same code, eager
    compiled_model = csf.compile(model, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    @csf.trace
    def training_step(inputs, targets):
        outputs = compiled_model(inputs)
        loss = loss_fn(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        log_loss(loss)                  # a @csf.step_closure: runs after each step with the real value
        return loss

    for inputs, targets in loader:
        loss = training_step(inputs, targets)   # traced at the first call, then the graph runs

On a CSX backend the decorated step is traced once (every call with ``retrace_every_iteration=True``) into a
static graph that runs every call; it returns copies of its outputs. The optimizers it steps are found among
the names the function uses (globals and enclosing variables) or given with ``backend.register_optimizer``.
Gradients live inside the step: each traced step starts without gradients and keeps none afterwards.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch

from ...errors import CompileError, ConfigError, CsfError
from ..eager import missing_cuda
from ...graph.compiler import CompileCache, StaticStep, device_for_host
from ...graph.tracer import active, step_closure
from .schema import DEFAULT_COMPILE_DIR, CsxConfig, default_compiler, graph_compiler_problem, num_csx_problem

__all__ = ["backend", "compile", "trace", "step_closure", "Backend", "EagerHandle", "CsxBackendHandle",
           "CompiledModel"]

#: Settings each device type understands here (CSX: every ``backend`` setting; ``type`` is the argument).
SETTINGS = {
    "CSX": {**{k: v for k, v in vars(CsxConfig()).items() if k != "type"}, "graph_compiler": None},
    "CPU": {"threads": 0},
    "GPU": {"threads": 0, "device_index": 0},
}

_LIVE: "weakref.WeakSet[Backend]" = weakref.WeakSet()
_CURRENT: "weakref.ref[Backend] | None" = None


class Backend:
    """A device for custom loops; ``csf.backend(...)`` makes one."""

    device_type = "CPU"
    is_csx = False

    def __init__(self, device_type: str, **settings):
        self.device_type = device_type
        self.settings = settings
        self.device = torch.device("cpu")
        self.models: list[torch.nn.Module] = []  # CompiledModels on CSX

    def __repr__(self) -> str:
        return f"csf.backend({self.device_type!r}, {', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"


class EagerHandle(Backend):
    """CPU/GPU: ``csf.compile`` moves the model, ``@csf.trace`` runs the function as it is."""

    def __init__(self, device_type: str, **settings):
        super().__init__(device_type, **settings)
        if device_type == "GPU":
            problem = missing_cuda("csf.backend('GPU')", "use 'CPU' or 'CSX'")
            if problem:
                raise ConfigError(problem)
            self.device = torch.device("cuda", settings.get("device_index") or 0)
        if settings.get("threads"):
            torch.set_num_threads(settings["threads"])


class CsxBackendHandle(Backend):
    """CSX: traced steps run as static graphs (see ``docs/guides/csx.md``)."""

    is_csx = True

    def __init__(self, **settings):
        super().__init__("CSX", **settings)
        self.retrace_every_iteration = bool(settings["retrace_every_iteration"])
        self.compile_only, self.validate_only = bool(settings["compile_only"]), bool(settings["validate_only"])
        if self.compile_only and self.validate_only:
            raise ConfigError("csf.backend('CSX'): compile_only and validate_only: choose one of them")
        self.num_csx = int(settings["num_csx"])
        why = num_csx_problem(self.num_csx)
        if why:
            raise ConfigError(f"csf.backend('CSX'): num_csx={self.num_csx} {why}")
        self.num_workers_per_csx = int(settings["num_workers_per_csx"])
        self.compile_dir = settings["compile_dir"] or DEFAULT_COMPILE_DIR
        self.cache = CompileCache(self.compile_dir)
        self.graph_compiler = settings["graph_compiler"] or default_compiler()
        if (problem := graph_compiler_problem(self.graph_compiler, "graph_compiler")) is not None:
            raise ConfigError(f"csf.backend('CSX'): {problem}")
        self.device = device_for_host()
        self.optimizers: list = []
        self.steps: dict[Callable, StaticStep] = {}
        self.compile_report: dict | None = None
        self.global_step = 0

    def register_optimizer(self, optimizer) -> None:
        """Make an optimizer's state part of the traced steps (needed only when the traced function reaches
        it other than through a global or enclosing variable)."""
        if not any(optimizer is o for o in self.optimizers):
            self.optimizers.append(optimizer)

    @property
    def traces(self) -> int:
        return sum(step.traces for step in self.steps.values())

    def summary(self) -> dict:
        return {"device_type": "CSX", "traces": self.traces, "global_step": self.global_step,
                "steps": {step.name: step.stats() for step in self.steps.values()}}

    # -- traced functions ---------------------------------------------------------------------------------
    def run_traced(self, fn: Callable, args: tuple, kwargs: dict):
        outer = active()
        if outer is not None:
            raise CompileError(f"{getattr(fn, '__name__', 'step')}: a @csf.trace function was called inside the "
                               f"traced step '{outer.name}'; one step is one graph: call the inner function "
                               "undecorated, or call both steps from the training loop")
        step = self.steps.get(fn)
        optimizers = list(self.optimizers)
        for opt in _optimizers_used_by(fn):
            if not any(opt is o for o in optimizers):
                optimizers.append(opt)
        if step is None:
            step = self.steps[fn] = StaticStep(fn, getattr(fn, "__name__", "step"),
                                               retrace=self.retrace_every_iteration, cache=self.cache,
                                               modules=[m.model for m in self.models], optimizers=optimizers,
                                               graph_compiler=self.graph_compiler, on_compile=_fallback_notice)
        else:
            step.tracer.optimizers[:] = optimizers
            step.tracer.modules[:] = [m.model for m in self.models]
        args, kwargs = _to_device((args, kwargs), self.device)
        self._check_batch(args, kwargs)
        if self.validate_only:
            step.validate_only(args, kwargs)
            return None
        if self.compile_only:
            compiled = step.compile_only(args, kwargs)
            self.compile_report = compiled.report
            return None
        out = step(args, kwargs, iteration=step.executions + 1, global_step=self.global_step)
        self.global_step += 1
        return out

    def _check_batch(self, args, kwargs) -> None:
        if self.num_csx <= 1:
            return
        leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        why = num_csx_problem(self.num_csx, leaves[0].shape[0]) if leaves and leaves[0].ndim else None
        if why:
            raise CompileError(f"num_csx={self.num_csx} {why}")


def _to_device(tree, device: torch.device):
    if device.type == "cpu":
        return tree
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _optimizers_used_by(fn: Callable) -> list:
    """Optimizers the traced function refers to by a global or an enclosing variable (or its ``self``)."""
    seen: list = []
    candidates: list[Any] = []
    code = getattr(fn, "__code__", None)
    if code is not None:
        globals_ = getattr(fn, "__globals__", {})
        candidates += [globals_[name] for name in code.co_names if name in globals_]
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                candidates.append(cell.cell_contents)
            except ValueError:  # empty cell
                pass
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        candidates += list(vars(owner).values()) if hasattr(owner, "__dict__") else []
    for obj in candidates:
        if isinstance(obj, torch.optim.Optimizer) and not any(obj is s for s in seen):
            seen.append(obj)
    return seen


def _fallback_notice(compiled) -> None:
    """One warning line when the graph compiler could not compile a traced step's graph."""
    info = compiled.report.get("graph_compiler", {})
    if info.get("status") == "fallback":
        warnings.warn(f"csf.trace: {compiled.report.get('step')}: graph_compiler={info['name']} is not available "
                      f"({info['reason']}); the interpreted graph runs", RuntimeWarning, stacklevel=2)


def backend(backend_type: str, **settings) -> Backend:
    """A backend of ``backend_type`` (``"CSX"``, ``"CPU"`` or ``"GPU"``, any case) with its settings.

    CSX settings: ``retrace_every_iteration``, ``compile_only``, ``validate_only``, ``num_csx``,
    ``num_workers_per_csx``, ``compile_dir``, ``graph_compiler`` (``inductor``/``none``; default
    ``$CSF_CSX_GRAPH_COMPILER`` or ``none``). A setting another device type owns is an error, and one process
    holds backends of one device type at a time.
    """
    global _CURRENT
    if not isinstance(backend_type, str) or backend_type.upper() not in SETTINGS:
        raise ConfigError(f"csf.backend: unknown backend type {backend_type!r}; use 'CSX', 'CPU' or 'GPU'")
    kind = backend_type.upper()
    own = SETTINGS[kind]
    for key in settings:
        if key not in own:
            owners = [t for t, fields in SETTINGS.items() if key in fields]
            if owners:
                raise ConfigError(f"csf.backend({kind!r}): {key} is a {'/'.join(owners)} setting that a {kind} "
                                  f"backend does not understand; remove it or use csf.backend({owners[0]!r}, ...)")
            raise ConfigError(f"csf.backend({kind!r}): unknown setting {key!r}; {kind} settings: "
                              f"{', '.join(own) or 'none'}")
    for other in list(_LIVE):
        if other.device_type != kind:
            raise ConfigError(f"csf.backend({kind!r}): a {other.device_type} backend already exists in this process; "
                              "one process uses one device type (drop the other backend and its compiled models "
                              "first, or run the other device type in its own process)")
    values = {**own, **settings}
    made = CsxBackendHandle(**values) if kind == "CSX" else EagerHandle(kind, **values)
    _LIVE.add(made)
    _CURRENT = weakref.ref(made)
    return made


def current_backend() -> Backend | None:
    return _CURRENT() if _CURRENT is not None else None


class CompiledModel(torch.nn.Module):
    """What ``csf.compile`` returns on CSX: calls the model; registers it with the step being traced."""

    def __init__(self, model: torch.nn.Module, backend: CsxBackendHandle, index: int):
        super().__init__()
        self.model = model
        self.backend = backend
        self.index = index

    def forward(self, *args, **kwargs):
        ctx = active()
        if ctx is not None:
            ctx.use_model(self)
        return self.model(*args, **kwargs)


def compile(model: torch.nn.Module, backend: Backend | None = None):  # noqa: A001 - mirrors cstorch.compile
    """Prepare ``model`` for ``backend``: on CSX a ``CompiledModel`` whose parameters become state of the
    traced steps; on CPU/GPU the model itself, moved to the device."""
    backend = backend or current_backend()
    if backend is None:
        raise CsfError("csf.compile: create a backend first, e.g. backend = csf.backend('CSX')")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"csf.compile expects a torch.nn.Module, got {type(model).__name__}")
    model.to(backend.device)
    if not isinstance(backend, CsxBackendHandle):
        backend.models.append(model)
        return model
    compiled = CompiledModel(model, backend, len(backend.models) + 1)
    backend.models.append(compiled)
    return compiled


class TracedFunction:
    """What ``@csf.trace`` returns: calling it runs one step on the current backend."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "step")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        backend = current_backend()
        if backend is None:
            raise CsfError(f"{self.__name__}: create a backend with csf.backend(...) before calling a "
                           "@csf.trace function")
        if not backend.is_csx:
            return self.fn(*args, **kwargs)
        return backend.run_traced(self.fn, args, kwargs)


def trace(fn: Callable) -> TracedFunction:
    """Decorator: the function is one training/evaluation step, traced into a static graph on CSX."""
    return TracedFunction(fn)


def _reset() -> None:
    """Forget every backend (tests)."""
    global _CURRENT
    _LIVE.clear()
    _CURRENT = None
