"""Eager execution on CPU or CUDA, single process, DDP or FSDP (``backend.strategy``), any precision policy;
the built-in ``eager`` plugin supplies it for the device types CPU and GPU."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import torch
import torch.distributed as dist

from .. import step
from ..compat import needs_torch
from ..config import for_each_stage, stage_configs
from ..config.ranges import MAX_PARALLEL, MAX_TIMEOUT_S, check_range
from ..config.readonly import ReadOnly
from ..data import move_to
from ..errors import ConfigError
from ..hookspecs import hookimpl
from ..precision import policy
from .base import BackendBase, BackendSpec
from .compile import COMPILE_MODES
from .distributed import DEFAULT_TIMEOUT_S, all_ranks_agree, init_process_group, timeout
from .eager_step import EagerRunner, StepRunner

if TYPE_CHECKING:
    from .compile.session import CompileSession


class Strategy(str, Enum):
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"


class MatmulPrecision(str, Enum):
    """``torch.set_float32_matmul_precision``'s levels."""
    highest = "highest"
    high = "high"
    medium = "medium"


@dataclass
class CpuConfig(ReadOnly):
    """``backend.*`` on CPU."""
    type: str = "CPU"
    """The device type this backend runs (``device=cpu`` and ``backend=cpu`` set it)."""
    strategy: Strategy = Strategy.single
    """``single`` process, ``ddp`` (data parallel under torchrun; gloo on CPU, NCCL on GPU) or ``fsdp``
    (parameters, gradients and optimizer state sharded over the ranks: FSDP2 ``fully_shard``)."""
    fsdp_wrap: List[str] = field(default_factory=list)
    """With ``strategy=fsdp``: class names of the sub-modules sharded as their own units (e.g. the
    transformer block); the rest is sharded at the root."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Under torchrun: seconds a rank waits for the others in a collective (and at start-up) before it
    fails; a dead or stopped rank then ends the run instead of hanging it."""
    threads: Optional[int] = 0
    """torch intra-op threads on the host; 0 or ``null`` keeps torch's default. The same setting on every
    device type (CSX too), so a config that sets it runs anywhere."""
    compile: bool = False
    """Compile the training step (forward, loss and their backward; clipping and the optimizer update) and
    evaluation: in one CPU process the whole step as one traced graph (``backends/compile/whole_step.py``),
    otherwise its functions with ``torch.compile`` (``backends/compile/functions.py``). The first steps compile
    (seconds; an identical run reads the cache), graph breaks and recompilations are reported; if compiling
    fails the run goes on eagerly with a warning. On CSX the step is always traced and compiled: see its
    ``backend.graph_compiler``."""
    compile_mode: str = "default"
    """With ``compile``: ``default``, ``reduce-overhead`` (CUDA graphs on a GPU: the least launch overhead) or
    ``max-autotune`` (also searches kernel configurations: longer compiles)."""
    compile_fullgraph: bool = False
    """With ``compile``: a graph break (code Dynamo cannot capture, such as ``.item()`` or ``if tensor:`` in the
    model) is an error before the first step changes anything, instead of a warning and that part run eagerly."""
    compile_whole_step: Optional[bool] = None
    """With ``compile``, in one CPU process: ``true`` traces the whole step once into one graph (the fastest step
    for a small model; its first compile grows with the model's depth); ``false`` compiles the step's functions
    with ``torch.compile``, each repeated block (a transformer's layer) once for every layer; ``null`` (the
    default) is ``false`` for a model of repeated blocks (its first compile then stays short however deep the
    model) and ``true`` otherwise. In the whole step the Python values the step reads (a counter or flag of the
    model's that changes between steps) are fixed at the trace, as on CSX; compiled per function they are
    checked at every step, and a change recompiles once."""
    float32_matmul_precision: Optional[MatmulPrecision] = None
    """float32 matrix products: ``highest`` (true float32), ``high`` (TensorFloat-32 on GPUs that have it,
    Ampere and newer: a 10-bit mantissa, several times faster) or ``medium`` (bfloat16 inside: on a GPU, and
    on a CPU whose oneDNN kernels have it); set with ``torch.set_float32_matmul_precision`` when the run
    starts. ``null`` leaves the process's setting (torch's default is ``highest``)."""


@dataclass
class GpuConfig(CpuConfig):
    """``backend.*`` on GPU."""
    type: str = "GPU"
    """The device type this backend runs (``device=gpu`` and ``backend=gpu`` set it)."""
    device_index: int = 0
    """The CUDA device index for single-process runs (DDP uses LOCAL_RANK)."""


def missing_cuda(what: str, fix: str = "use device=cpu (or device=csx to emulate a Cerebras system)") -> str | None:
    """The one report of a missing CUDA device (``what`` names the setting), or ``None`` when present."""
    if torch.cuda.is_available():
        return None
    return f"{what}: gpu needs CUDA, which is not available on this machine; {fix}"


#: How long ``finish`` waits for the pending stop-agreement all-reduce at the end of a stage or fit.
FINISH_WAIT_S = 30


class EagerBackend(BackendBase):
    """CPU/GPU: each ``train_batch`` is a micro-batch of ``csframework.step``, run as it arrives."""

    def __init__(self, run):
        cfg = run.stage_config
        self.device_type = cfg.device.type
        backend = cfg.backend
        self.sharded = backend.strategy == Strategy.fsdp  # checkpoints: every rank writes its shards
        self.distributed = backend.strategy in (Strategy.ddp, Strategy.fsdp)
        self.wrap = list(backend.fsdp_wrap)
        if self.device_type == "GPU":
            problem = missing_cuda("device")
            if problem:
                raise ConfigError(problem)
            index = int(os.environ.get("LOCAL_RANK", 0)) if self.distributed else backend.device_index
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if backend.float32_matmul_precision is not None:  # process-wide; a sweep's jobs restore it
            torch.set_float32_matmul_precision(backend.float32_matmul_precision.value)
        if backend.threads:
            torch.set_num_threads(backend.threads)
        self.precision = policy(cfg.precision, self.device.type)
        if self.sharded:  # FSDP casts the parameters itself (MixedPrecisionPolicy): no autocast
            self.param_dtype = self.precision.dtype
            if self.param_dtype is not None:  # (FLOAT32, the shared null policy, has none to drop)
                self.precision.dtype = None
        self.max_grad_norm = cfg.optimizer.max_grad_norm
        self.accum = cfg.loop.grad_accum_steps
        if self.distributed:
            if not dist.is_initialized():
                init_process_group("nccl" if self.device_type == "GPU" else "gloo", backend.timeout_s)
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            # host-side flags travel over gloo: no device synchronisation for them under NCCL
            self.host_group = (dist.new_group(backend="gloo", timeout=timeout(backend.timeout_s))
                               if dist.get_backend() == "nccl" else None)
        self._signal_flag = None  # (tensor, pending all-reduce) of any_rank_signal
        self.compile = backend.compile
        self.compile_settings = dict(mode=backend.compile_mode, fullgraph=backend.compile_fullgraph)
        self.whole_step = backend.compile_whole_step
        self.compiled: CompileSession | None = None  # under backend.compile: what compiling costs and finds
        #: the step's runner, chosen once at ``attach`` (``eager_step``); a fallback replaces it once (``install``)
        self.runner: StepRunner
        self.trained: tuple = ()  # (optimizer, model) of the stage, from attach

    def any_rank_signal(self, signum: int | None) -> int | None:
        """The stop signal any rank had received one step ago, the same on every rank (all ranks must stop
        after the same step, or the others would wait forever in the next gradient all-reduce).

        Called at every step boundary with this rank's signal: it reads the small all-reduce started at the
        previous boundary and starts the next, so the collective runs while the step computes.
        """
        if self.world_size == 1:
            return signum
        agreed = None
        if self._signal_flag is not None:
            self._signal_flag[1].wait()
            agreed = int(self._signal_flag[0].item()) or None
        flag = torch.tensor([signum or 0], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.host_group, async_op=True)
        self._signal_flag = (flag, work)
        return agreed

    def finish(self) -> None:
        """The run's stage or fit ended: the compiled step gives the process's torch settings back, and the
        stop-agreement all-reduce still in flight is waited for (bounded). Every rank started it at the same step
        boundary, so it completes unless a rank has died."""
        if self.compiled is not None:
            self.compiled.close()
        pending, self._signal_flag = self._signal_flag, None
        if pending is None:
            return
        try:
            pending[1].wait(datetime.timedelta(seconds=FINISH_WAIT_S))
        except RuntimeError:  # a rank died or hangs: nothing to agree on any more
            pass

    def broadcast(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_ranks_agree(self, flag: bool) -> bool:
        return flag if self.world_size == 1 else all_ranks_agree(flag, self.host_group)

    # -- sharded checkpoints (strategy=fsdp: DCP, see backends.fsdp) ---------------------------------------
    def save_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        if not self.sharded:
            return super().save_sharded(model, optimizer, directory)
        from . import fsdp

        fsdp.save(model, optimizer, directory)

    def load_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                     files: set[str]) -> None:
        if not self.sharded:
            return super().load_sharded(model, optimizer, directory, files)
        from . import fsdp

        fsdp.load(model, optimizer, directory, files)

    def read_shard_metadata(self, path: Path) -> None:
        if not self.sharded:
            return super().read_shard_metadata(path)
        from . import fsdp

        fsdp.read_metadata(path)

    # -- assembly -----------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to the device; returns the module to call (a DDP wrapper under ``ddp``; the model
        itself, sharded in place, under ``fsdp``)."""
        model.to(self.device)
        if self.sharded:
            from torch.distributed.fsdp import FSDPModule

            from .fsdp import shard

            if isinstance(model, FSDPModule):
                return model
            if not any(True for _ in model.parameters()):
                raise ConfigError("backend.strategy=fsdp: the model has no parameters to shard; use "
                                  "backend.strategy=ddp or single")
            return shard(model, self.wrap, self.param_dtype)
        if self.distributed and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            ids = [self.device.index] if self.device.type == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model

    def fused_optimizer(self, model: torch.nn.Module) -> bool:
        """Under dynamic loss scaling: so that no step waits for the device (``precision.FUSED_SKIPPING``)."""
        return self.precision.fused_optimizer(model)

    def attach(self, run) -> None:
        """Choose the step's runner (under ``backend.compile`` it needs the stage's optimizer)."""
        self.trained = (run.optimizer, run.model)  # for load_state_dict (Precision.prepare)
        layout = dict(accum=self.accum, distributed=self.distributed, sharded=self.sharded,
                      max_grad_norm=self.max_grad_norm)
        if not self.compile:
            self.runner = EagerRunner(self.precision, run.module, **layout)
            # never replaced: the backend's call goes straight to it (no frame of train_batch's own a batch)
            self.train_batch = self.runner.train_batch  # type: ignore[method-assign]
            return
        from .compile import step as compile_step  # here: an eager run imports no compile module (start-up)

        self.compiled, self.runner = compile_step.runner(run, self.precision, self.device, install=self._install,
                                                         whole_step_setting=self.whole_step,
                                                         **self.compile_settings, **layout)

    def _install(self, runner: StepRunner) -> None:
        """The step's runner from now on (a fallback's, once)."""
        self.runner = runner

    def to_device(self, batch):
        if self.device.type == "cpu":
            return batch
        return move_to(batch, self.device, non_blocking=True)

    # -- steps --------------------------------------------------------------------------------------------
    def train_batch(self, run, batch, last: bool) -> dict:
        return self.runner.train_batch(run, batch, last)

    def eval_batch(self, run, batch) -> dict:
        carried = run.state.carried  # a stateful model (never compiled: csframework.carried.refusals)
        if carried is not None:
            with self.precision.autocast():
                outputs = carried.forward(run.module, batch)
        else:
            outputs = self.runner.evaluate(batch)
        # under inference_mode (the loop's default) no output can require grad: nothing to detach
        return outputs if torch.is_inference_mode_enabled() else step.detached(outputs)

    def _graph_scaler(self):
        """Under backend.compile, the in-graph loss scaler that holds the scale instead of the GradScaler, if any."""
        return self.compiled.loss_scaler if self.compiled is not None else None

    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (one synchronisation), or ``None`` without dynamic scaling."""
        graph = self._graph_scaler()
        if graph is not None:
            return float(graph.scale)
        scaler = self.precision.scaler
        return scaler.get_scale() if scaler is not None else None

    def state_dict(self) -> dict:
        graph = self._graph_scaler()  # GradScaler's keys: the checkpoint loads into either
        return {"precision": graph.state_dict() if graph is not None else self.precision.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.precision.load_state_dict(state.get("precision", {}))
        graph = self._graph_scaler()
        if graph is not None:
            graph.load_state_dict(state.get("precision", {}))
        # the loaded optimizer has the saved settings: fit them again
        if self.trained:
            self.precision.prepare(*self.trained)
        if self.compiled is not None:
            self.compiled.prepare_optimizer()

    def summary(self) -> dict:
        return {"compile": self.compiled.summary()} if self.compiled is not None else {}

    def compile_seconds(self) -> float:
        """Seconds ``backend.compile`` has spent compiling the step and evaluation functions (0 eagerly)."""
        return self.compiled.seconds if self.compiled is not None else 0.0


class EagerPlugin:
    """The built-in plugin of the CPU and GPU device types (its config files are in csframework's own
    ``conf/``, which names ``device: cpu`` as the default)."""

    name = "eager"
    specs = {"CPU": BackendSpec("CPU", CpuConfig, EagerBackend), "GPU": BackendSpec("GPU", GpuConfig, EagerBackend)}

    @hookimpl
    def csframework_device_types(self) -> list[str]:
        return list(self.specs)

    @hookimpl(trylast=True)  # asked after every other plugin: a package may replace it
    def csframework_backend(self, device_type: str) -> BackendSpec | None:
        return self.specs.get(device_type)

    @hookimpl
    def csframework_validate(self, config) -> list[str]:
        return for_each_stage(config, _rules) + [
            f"{prefix}backend.strategy: {cfg.backend.strategy.value} differs from the run's "
            f"{config.backend.strategy.value}; sharded (fsdp) and unsharded stages cannot mix"
            for prefix, cfg in stage_configs(config)
            if isinstance(cfg.backend, CpuConfig) and isinstance(config.backend, CpuConfig)
            and Strategy.fsdp in (cfg.backend.strategy, config.backend.strategy)
            and cfg.backend.strategy != config.backend.strategy]


def _rules(cfg) -> list[str]:
    problems = [missing_cuda("device")] if cfg.device.type == "GPU" else []
    b = cfg.backend
    if isinstance(b, CpuConfig) and b.type == cfg.device.type:
        problems += check_range("backend.threads", b.threads, 0, MAX_PARALLEL, hint=" (0 keeps torch's default)")
        problems += check_range("backend.timeout_s", b.timeout_s, 0.0, MAX_TIMEOUT_S, open_low=True)
        problems += _fsdp_rules(cfg) + _compile_rules(b)
    if isinstance(b, GpuConfig) and cfg.device.type == "GPU":
        count = torch.cuda.device_count()
        problems += check_range("backend.device_index", b.device_index, 0, (count or MAX_PARALLEL) - 1,
                                hint=f" (this machine has {count} CUDA devices)" if count else "")
    return [p for p in problems if p]


def _compile_rules(b: CpuConfig) -> list[str]:
    """``backend.compile_mode`` is one of torch.compile's modes; it and ``compile_fullgraph`` need ``compile``."""
    problems = []
    if b.compile_mode not in COMPILE_MODES:
        problems.append(f"backend.compile_mode: {b.compile_mode!r} is not one of {', '.join(COMPILE_MODES)}; "
                        "use backend.compile_mode=default (or reduce-overhead, max-autotune)")
    if not b.compile:
        for key, unset in (("compile_mode", "default"), ("compile_fullgraph", False), ("compile_whole_step", None)):
            if getattr(b, key) != unset and getattr(b, key) in COMPILE_MODES + (True, False):
                problems.append(f"backend.{key}: it applies with backend.compile=true (compile is false); "
                                "set backend.compile=true or remove it")
    return problems


def _fsdp_rules(cfg) -> list[str]:
    """What ``strategy=fsdp`` cannot do here (a model without parameters is refused when it is built)."""
    b = cfg.backend
    if b.strategy != Strategy.fsdp:
        return ([f"backend.fsdp_wrap: it applies to backend.strategy=fsdp only (strategy is {b.strategy.value}); "
                 "remove it or set backend.strategy=fsdp"] if b.fsdp_wrap else [])
    from .fsdp import FSDP2_TORCH

    too_old = needs_torch("backend.strategy=fsdp (FSDP2 fully_shard)", FSDP2_TORCH)
    if too_old:
        return [f"{too_old} (backend.strategy=ddp)"]
    if cfg.precision.name == "float16" or cfg.precision.loss_scaling not in (None, "none"):
        return ["precision: backend.strategy=fsdp computes in FSDP's mixed precision, without loss scaling; "
                "use precision=bfloat16 or float32 (loss_scaling null)"]
    return []
