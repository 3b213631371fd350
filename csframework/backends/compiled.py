"""``backend.compile=true``: the eager backend's step and evaluation compiled.

In one CPU process the whole step is one traced graph where it can be (``whole_step``: the fastest there);
``CompiledStep`` sets that up and reports on it as on the rest. Otherwise (GPU, DDP/FSDP, gradient accumulation,
hooks inside the step, a step that does not trace) the step's sequence is still
``csframework.step``'s and three functions of it are compiled (TorchDynamo captures them, TorchInductor
generates their code):

* ``forward``: a micro-batch's forward and loss under the precision policy's autocast. AOTAutograd compiles its
  backward with it, so ``loss.backward()`` runs compiled code too (the loss scaling's multiplication, the
  ``1/grad_accum_steps`` division and the call itself stay eager: one operation each);
* ``update``: the gradient clipping and the optimizer's step (built-in or ``_target_``), one graph. Every
  optimizer's learning rates become tensors that the schedule fills in place, so a new rate is an input, not a
  recompilation (another optimizer's ``step`` reads it as a number); torch's optimizers, and subclasses keeping
  torch's ``step``, run their ``foreach`` path with ``capturable`` state (the fastest compiled update measured:
  docs/performance.md). Under dynamic loss scaling (``precision=float16``) the scaling
  is tensor operations, as on CSX (``csx/precision.GraphLossScaler``): the gradients are unscaled with one
  overflow check and the scale updated (one kernel each, between the compiled functions), and the compiled update
  is ``csx/optim``'s traceable optimizer step, which skips an overflowing step with ``torch.where``: nothing waits
  for the device. A custom optimizer that cannot create its state before the first step keeps ``GradScaler``
  and runs its update eagerly;
* ``evaluate``: evaluation's forward and loss.

A model of repeated blocks (a transformer's layers) is compiled by region instead (``regions``): each block
class's ``forward`` once, run for every layer, the rest of the forward and evaluation eager around it. On the CPU
``payoff`` times the compiled step against a few eager ones and says when compiling does not pay.

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
warning. The process-wide torch settings this needs are held only while the run uses them (``compile_scope``).
"""
from __future__ import annotations

import linecache
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .. import step
from ..compat import cpp_compiler, inductor_default_cache_dir, pick_vec_isa
from ..errors import ConfigError
from ..precision import NO_AUTOCAST
from . import regions
from .cachedir import trusted_root
from .compile_scope import CACHE_ENV, CompileScope, fresh
from .csx.compiler import CompileCache, Compiled
from .csx import optim as csx_optim
from .csx.optim import preinitialisable, preinitialize, unwrapped
from .csx.precision import CsxPrecision, GraphLossScaler
from .payoff import Payoff
from .whole_step import WholeStep, batch_shapes, first_trace_failed

#: ``backend.compile_mode``'s values (``torch.compile``'s modes).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
#: Where Inductor keeps generated code and built kernels unless ``$TORCHINDUCTOR_CACHE_DIR`` says otherwise.
DEFAULT_CACHE_DIR = "~/.cache/csframework/inductor"
#: Compilations of one function after its first (new shapes) before it runs eagerly. A recompilation for any other
#: reason (a guard on a Python value failed: ``.item()`` in the forward, a counter the model reads) is its last.
MAX_RECOMPILES = 8


#: The compiled functions that run the model's forward.
MODEL_FUNCTIONS = ("forward", "evaluate")


def cache_dir() -> Path:
    """Inductor's cache directory: ``$TORCHINDUCTOR_CACHE_DIR``, else ``~/.cache/csframework/inductor`` (not
    Inductor's default in the temporary directory, which the system may clear). Inductor writes its entries
    atomically under file locks, so concurrent runs (sweep jobs, torchrun ranks) share it safely."""
    given = os.environ.get(CACHE_ENV)
    # Inductor writes its default into the variable once it has looked: that is no user's choice
    if given and os.path.abspath(given) != os.path.abspath(inductor_default_cache_dir()):
        return Path(given)
    return Path(os.path.expanduser(DEFAULT_CACHE_DIR))


def _isa_marker_path(root: Path) -> Path:
    """The file saying that Inductor built and ran code for this CPU's vector instructions in cache ``root``."""
    return root / f"csframework-vec-isa-{torch.backends.cpu.get_cpu_capability().lower()}.ok"


def _trust_vector_isa(root: Path) -> bool:
    """Check the CPU's vector instructions once per cache, not in every process: Inductor builds and runs test
    programs for it (about 4 s of a cached run's compile time). Returns whether the check passed, here or in an
    earlier run (then ``CompileScope`` sets Inductor's ``cpp.vec_isa_ok``: the check's result is part of
    Inductor's cache keys, so every run, the first included, compiles with it set)."""
    if torch.cuda.is_available():
        return False
    marker = _isa_marker_path(root)
    if not marker.is_file():
        if not pick_vec_isa():  # none works: Inductor's own check says so again and builds scalar code
            return False
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:  # a read-only cache: the check runs again next time
            pass
    return True


#: The setting that names the C++ compiler Inductor builds CPU code with.
COMPILER_SETTING = "CXX"
#: Inductor's errors of a C++ compiler that is missing or fails (their names, as in a failure's one line).
COMPILER_ERRORS = ("InvalidCxxCompiler", "CppCompileError")


def missing_compiler() -> str | None:
    """Why Inductor cannot build C++ on this machine (one line naming ``CXX`` and the fix), or ``None``: it looks
    for ``$CXX`` (else ``g++`` on ``PATH``) and runs it."""
    try:
        cpp_compiler()
    except Exception as e:
        return compiler_failure(_one_line(e))
    return None


def compiler_failure(reason: str) -> str:
    """``reason`` (a compiler's failure) with the setting to fix."""
    given = os.environ.get(COMPILER_SETTING)
    setting = (f"{COMPILER_SETTING}={given}" if given
               else f"{COMPILER_SETTING} is unset (Inductor looks for g++ on PATH)")
    return (f"no working C++ compiler for Inductor: {setting}: {reason}; set {COMPILER_SETTING} to a C++ compiler "
            "(g++ or clang++)")


@dataclass
class GraphBreak:
    """Where and why Dynamo split a compiled function."""
    where: str  # "file:line" of the user's code, or "" when none is the user's
    reason: str  # one line

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}" if self.where else self.reason


#: The usual graph breaks: words of Dynamo's reason or of the user's line, what the construct is, and its fix.
CONSTRUCTS = ((("item()", "tensor.item"), "`.item()` reads a tensor's value on the host",
               "keep the value a tensor (torch.where for a choice), or read it in a hook outside the step "
               "(on_train_step_end)"),
              (("data-dependent", "could not guard", "generic_jump"), "Python control flow on a tensor's value",
               "use torch.where instead of a Python branch on a tensor's value, or move the check to a hook outside "
               "the step (on_train_step_end)"),
              (("print",), "print() inside the compiled code",
               "remove the print from the forward, or log from a hook outside the step"))
OTHER_FIX = "move that code out of the model's forward (into a hook outside the step) or make it a tensor operation"


def _internal(filename: str) -> bool:
    """Frames of torch, csframework and Python itself are not the user's."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return (filename.startswith(here) or f"{os.sep}torch{os.sep}" in filename or "<" in filename
            or f"{os.sep}lib{os.sep}python" in filename and "site-packages" not in filename)


def describe_break(reason: str, stack: list) -> GraphBreak:
    """Dynamo's reason for a graph break and the user's stack there, as the user's line and one line saying
    what the construct there is and its fix (Dynamo's own words where the construct is not a usual one)."""
    frame = next((f for f in reversed(stack) if not _internal(f.filename)), stack[-1] if stack else None)
    where = f"{frame.filename}:{frame.lineno}" if frame is not None else ""
    code = ((frame.line or linecache.getline(frame.filename, frame.lineno)) if frame is not None else "").strip()
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    # Dynamo's first line says only that it was a call; the next names what could not be traced
    useful = [ln for ln in lines if not ln.startswith(("Encountered graph break", "Developer debug context",
                                                        "For more details", "Hint: "))]
    text = " ".join((useful or lines or ["unknown"])[:2])
    words = f"{text} {code}".lower()
    construct, fix = next(((what, fix) for keys, what, fix in CONSTRUCTS if any(k in words for k in keys)),
                          (text if len(text) <= 240 else text[:237] + "...", OTHER_FIX))
    return GraphBreak(where, (f"`{code}`: " if code else "") + f"{construct}; fix: {fix}")


class Recorder:
    """The backend handed to ``torch.compile``: Inductor with ``mode``'s options, counting what it compiles and
    the graph breaks Dynamo reports with each graph."""

    def __init__(self, mode: str):
        import torch._inductor

        self.options = torch._inductor.list_mode_options(mode)
        self.breaks: list[GraphBreak] = []
        self.graphs = 0
        self.failed: str | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            found = describe_break(str(reason.reason), list(reason.user_stack or []))
            if all(str(b) != str(found) for b in self.breaks):
                self.breaks.append(found)
        self.graphs += 1
        return compile_fx(gm, example_inputs, config_patches=self.options)


def _signature(batch: Any) -> tuple:
    """The shapes and dtypes of a batch's tensors (what a recompilation is reported with)."""
    from torch.utils import _pytree as pytree

    return tuple((tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in pytree.tree_leaves(batch)
                 if isinstance(t, torch.Tensor))


def _one_line(error: BaseException) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def _failure(error: BaseException) -> str | None:
    """One line for an error of compiling (not of running the user's code), else ``None``."""
    from torch._dynamo.exc import BackendCompilerFailed

    if not isinstance(error, BackendCompilerFailed):
        return None
    return _one_line(error.inner_exception if getattr(error, "inner_exception", None) is not None else error)


def torch_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s update is torch's own code (a ``torch.optim`` class, or a user's subclass of one that
    keeps its ``step``): it takes ``foreach`` and ``capturable`` state."""
    return unwrapped(getattr(type(optimizer), "step", None)).__module__.startswith("torch.optim")


def prepare_optimizer(optimizer: torch.optim.Optimizer, device: torch.device, torch_step: bool = True) -> None:
    """Make ``optimizer``'s settings those the update compiles best with (again after a checkpoint is loaded,
    which brings back the saved ones): every learning rate is a tensor (float64 on the host, float32 on a GPU)
    that the schedule fills in place, so a new rate is an input of the compiled update, not a recompilation
    (torch's optimizers take it as it is; in another optimizer's ``step``, ``p.add_(u, alpha=-group["lr"])`` and
    the other arithmetic read it as a number). Torch's own update, where it is the one run (``torch_step``), runs
    ``foreach`` with ``capturable`` state."""
    own = torch_optimizer(optimizer)
    for group in optimizer.param_groups:
        if own and torch_step and "foreach" in group:
            group["foreach"] = True
        if own and torch_step and "capturable" in group:
            group["capturable"] = True
        lr = group.get("lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):  # (a group may have none: Adafactor's None)
            dtype = torch.float64 if device.type == "cpu" else torch.float32
            group["lr"] = torch.tensor(float(lr), dtype=dtype, device=device)
    if not own:
        return
    # capturable optimizers keep their step counts on the parameters' device
    for state in optimizer.state.values():
        count = state.get("step") if isinstance(state, dict) else None
        if isinstance(count, torch.Tensor) and count.device != device:
            state["step"] = count.to(device=device, dtype=torch.float32)


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable:
    """``optimizer.step`` without torch's wrappers when nothing hooks it: the wrapper that switches grad mode
    breaks the graph on purpose (the update runs under ``no_grad`` here anyway), and the profiler's is ignored
    when compiling. With step hooks registered, ``step`` itself (its hooks run, the graph breaks)."""
    from torch.optim import optimizer as opt_module

    hooked = (getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None)
              or getattr(opt_module, "_global_optimizer_pre_hooks", None)
              or getattr(opt_module, "_global_optimizer_post_hooks", None))
    raw = type(optimizer).step
    if hooked or "step" in vars(optimizer):  # hooks, or an instance's own step (a torch LRScheduler wraps it)
        return lambda skip: optimizer.step()
    while hasattr(raw, "__wrapped__"):
        raw = raw.__wrapped__
    return lambda skip: raw(optimizer)


class _CompileFailed(Exception):
    """Inductor could not compile the whole step's graph (the step then runs eagerly)."""


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
        self.reported = 0  # graph breaks already warned about
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
        self.recorder = Recorder(mode)
        options = dict(backend=self.recorder, fullgraph=fullgraph, dynamic=False)
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
        #: dynamic loss scaling as tensor operations (``csx/precision.py``), wherever the optimizer's update traces:
        #: the overflow check, the skipped update and the new scale are then compiled with the step (or with the
        #: update), and this scaler, not the ``GradScaler``, holds the scale (``GradScaler``'s state keys)
        self.loss_scaler: GraphLossScaler | None = None
        if self.scaler is not None and not sharded and preinitialisable(type(run.optimizer)):
            self.precision = CsxPrecision(run.stage_config.precision, device)
            self.loss_scaler = self.precision.scaler
            self.loss_scaler.load_state_dict(self.scaler.state_dict())
        self._shapes: dict[str, tuple] = {}
        self.compiled_update = False
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
                                   on_compile=self._whole_compiled)
        else:
            self._compile_update(sharded)

    def _compile_update(self, sharded: bool) -> None:
        """Compile the update (clipping and the optimizer's step) as one function."""
        # FSDP2's parameters are DTensors whose update calls collectives: left to the eager optimizer
        self.compiled_update = not sharded and (self.scaler is None or self.loss_scaler is not None)
        if self.compiled_update:
            optimizer = self.run.optimizer
            self.prepare_optimizer()
            # the state the first step would create, created now: it is then no cause of a recompilation
            preinitialize(optimizer)
            if self.loss_scaler is None:
                self._step = _raw_step(optimizer)
            else:  # the traceable update, which skips an overflowing step with torch.where (no synchronisation)
                self._step = lambda skip: csx_optim.step(optimizer, skip=skip)
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
                self.scope.vec_isa_ok = _trust_vector_isa(self.cache_root)
            except Exception as e:  # the compiler runs, but cannot build the check's programs
                problem = compiler_failure(_one_line(e))
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
        """Train on ``batch`` with the whole step's graph; ``None`` when the step is not (or no longer) one graph
        and the caller runs it through the compiled functions (or eagerly, once compiling has failed)."""
        if self._notes:
            self._log_notes()
        whole = self.whole
        if whole is None or self.failed is not None:
            return None
        if self._eager_now:
            return whole.eager(batch)
        self.scope.enter()
        try:
            outputs = whole(batch, global_step)
        except _CompileFailed:
            self.whole = None
            return None
        except Exception as e:
            if not first_trace_failed(e):
                raise
            if whole.traced:  # a later shape does not trace: that batch runs eagerly
                self.run.log.warning("step_not_traced", problem=_one_line(e), result="this batch runs eagerly")
                return whole.eager(batch)
            # data-dependent code: Dynamo compiles what it can and reports the graph breaks
            self.whole = None
            self.run.log.info("step_compiled_per_function", reason=_one_line(e))
            self._compile_update(sharded=False)
            return None
        if whole.full and not self._limit_reported:
            self._limit_reported = True
            self.run.log.warning("recompile_limit", function="train_step", limit=MAX_RECOMPILES,
                                 problem=f"train_step was compiled {MAX_RECOMPILES + 1} times; from now on new shapes "
                                         "run eagerly: keep the batch shapes fixed (data.drop_last=true, padding to a "
                                         "few lengths)")
        return outputs

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
        found = payoff.verdict()
        # (a graph break, or a function that runs eagerly, has had its own warning: the step is not all compiled)
        if found is not None and not self.recorder.breaks and not self.eager:
            compiled, eager = (round(1e3 * s, 3) for s in found)
            self.run.log.warning("compile_not_faster", compiled_ms=compiled, eager_ms=eager,
                                 problem=f"the compiled step took {compiled} ms, the same step run eagerly {eager} ms "
                                         "(medians, after the first loop.log_every window): compiling does not pay "
                                         "for this model on this machine",
                                 result="the run goes on compiled; backend.compile=false saves the compile time")
        return outputs

    def prepare_optimizer(self) -> None:
        """The optimizer's settings for the compiled update (again after a checkpoint is loaded)."""
        prepare_optimizer(self.run.optimizer, self.device, torch_step=self.loss_scaler is None)

    def _whole_compiled(self, compiled: Compiled, seconds: float) -> None:
        """A graph of the whole step was compiled or loaded (before it runs): count and report it."""
        info = compiled.report.get("graph_compiler", {})
        if info.get("status") == "fallback":
            self._fall_back(info.get("reason", "unknown"))
            raise _CompileFailed
        self.seconds += seconds
        if info.get("status") == "loaded":
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
                reason = _failure(e)
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
        shape = _signature(args) if shape is None else shape
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
        if self.failed is not None:
            out["fallback"] = self.failed
        return out


class CompiledOps:
    """The precision policy's ``step.PrecisionOps`` around the compiled functions: the forward's autocast is
    inside the compiled forward, the optimizer step is the compiled update (clipping included: the step is
    then given no ``max_grad_norm``)."""

    def __init__(self, compiled: CompiledStep):
        self.precision, self.compiled = compiled.precision, compiled

    def autocast(self):
        return NO_AUTOCAST

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def unscale(self, optimizer):
        return self.precision.unscale(optimizer)

    def optimizer_step(self, optimizer, skip) -> None:
        if self.compiled.compiled_update and self.compiled.failed is None:
            self.compiled.apply_update(skip)
        else:
            self.precision.optimizer_step(optimizer, skip)

    def update(self) -> None:
        self.precision.update()
