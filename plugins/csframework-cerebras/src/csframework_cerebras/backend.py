"""``CerebrasBackend``: a csframework run on cerebras-pytorch (cstorch).

The model goes through ``cstorch.compile``, the optimizer and schedule are their ``cstorch.optim``
equivalents (``optim.py``), and the train step, csframework's own sequence (``csframework.step``), runs
under ``@cstorch.trace``. The batches csframework's loader reads (its seeded order, its resume position) are
fed through a ``cstorch.utils.data.DataLoader`` and a ``DataExecutor`` (one per stage, for the steps left),
which moves each to the device and brackets each step. With ``backend.type=CPU`` cstorch runs the step
eagerly, so its outputs are real tensors when it returns. ``compile_only``/``validate_only`` (type CSX) trace
one step on cstorch's lazy device and lower it locally; what needs the cluster then ends the run with one
line naming ``cerebras.mgmt_address``. Checkpoints are csframework's (atomic, checksummed, ``keep_last``,
``resume=auto``): with the CPU backend the model and optimizer state live in host memory.
"""
from __future__ import annotations

import collections
import os
import shutil
import sys
from pathlib import Path

import torch

from csframework import step
from csframework.backends.base import BackendBase
from csframework.errors import ConfigError
from csframework.precision import FLOAT32

from .data import input_fn, loader_args
from .errors import cluster_problem, translate
from .optim import build_optimizer, build_schedule


def import_cstorch():
    """``cerebras.pytorch``, or a ``ConfigError`` saying how to install it."""
    try:
        import cerebras.pytorch as cstorch
    except ImportError as e:
        raise ConfigError(f"backend=cerebras: cerebras.pytorch cannot be imported ({e}); install it in its own venv: "
                          "pip install 'csframework-cerebras[cstorch]' (it pins torch==2.4.0)") from e
    return cstorch


class _Feed:
    """The batches csframework's loader read, handed one at a time to cstorch's DataLoader (its ``input_fn``
    returns this iterable)."""

    def __init__(self):
        self.queue: collections.deque = collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        if not self.queue:
            raise StopIteration
        return self.queue.popleft()


class CerebrasBackend(BackendBase):
    device_type = "CSX"

    def __init__(self, run):
        cfg = run.stage_config
        b = cfg.backend
        self.kind = b.type
        self.compile_only, self.validate_only = b.compile_only, b.validate_only
        self.dry_run = "compiled" if b.compile_only else "validated" if b.validate_only else None
        if self.kind == "CSX" and self.dry_run is None and not cfg.cerebras.mgmt_address:
            raise ConfigError("cerebras.mgmt_address: training on a Wafer-Scale Cluster needs the cluster's "
                              "management address; set cerebras.mgmt_address=HOST:PORT, or run locally with "
                              "backend.type=CPU or backend.compile_only=true")
        cstorch = self.cstorch = import_cstorch()
        self.max_grad_norm = cfg.optimizer.max_grad_norm
        self.artifact_dir = Path(run.output_dir) / "cerebras"
        cstorch.backends.csx.debug.retrace_every_iteration = b.retrace_every_iteration
        if self.kind == "CPU":
            self.cs = cstorch.backend("CPU", artifact_dir=str(self.artifact_dir))
        else:
            _lowering_tools_on_path()
            options = {"compile_dir": b.compile_dir} if b.compile_dir else {}
            self.cs = cstorch.backend("CSX", artifact_dir=str(self.artifact_dir), compile_only=b.compile_only,
                                      validate_only=b.validate_only, cluster_config=cluster_config(cstorch, cfg),
                                      **options)
        self.traces = 0  # how often the step's Python ran: once on CSX, or every step (CPU, retracing)
        self.run = None
        self._feed = _Feed()
        self._executor_steps = None
        self._traced_step = cstorch.trace(self._step)

    # -- assembly ---------------------------------------------------------------------------------------
    def prepare_model(self, model):
        return _Compiled(model, self.cstorch.compile(model, self.cs))

    def attach(self, run) -> None:
        """Replace the run's torch optimizer and schedule by their cstorch equivalents."""
        self.run = run
        cfg = run.stage_config
        run.optimizer = build_optimizer(self.cstorch, run.model, cfg.optimizer)
        run.scheduler = build_schedule(self.cstorch, run.optimizer, cfg.optimizer, run.total_steps(cfg))

    # -- steps ------------------------------------------------------------------------------------------
    def _step(self, batch):
        self.traces += 1
        return step.train_step(self.run, FLOAT32, self.run.module, [batch], self.max_grad_norm)

    def _device_batch(self, run, batch):
        """``batch`` through cstorch's DataLoader and DataExecutor (on the device, inside the executor's step)."""
        self._feed.queue.append(batch)
        for _ in range(2):  # a spent executor (its steps done) is replaced once
            if self._executor_steps is None:
                steps = max(1, run.total_steps(run.stage_config) - run.stage_step)
                loader = self.cstorch.utils.data.DataLoader(lambda: self._feed)
                self._executor_steps = iter(self.cstorch.utils.data.DataExecutor(loader, num_steps=steps))
            try:
                return next(self._executor_steps)
            except StopIteration:
                self._executor_steps = None
        raise RuntimeError("cstorch's DataExecutor yielded no batch")

    def train_batch(self, run, batch, last: bool) -> dict:
        try:
            return self._traced_step(self._device_batch(run, batch))
        except Exception as e:
            raise translate(e) from e

    def eval_batch(self, run, batch) -> dict:
        return step.detached(step.model_outputs(run.module(batch)))

    def finish(self) -> None:
        """End cstorch's run context (the executor of the stage)."""
        executor, self._executor_steps = self._executor_steps, None
        if executor is not None:
            executor.close()

    # -- compile_only / validate_only -------------------------------------------------------------------
    def dry_stage(self, run) -> None:
        """Trace one step on cstorch's lazy device and lower it locally (``compile_only``), or validate it
        (``validate_only``); what needs the cluster ends the run naming ``cerebras.mgmt_address``."""
        # the cluster's input workers build the loader themselves: a picklable input function (data.py)
        loader = self.cstorch.utils.data.DataLoader(input_fn, *loader_args(run))
        try:
            for device_batch in self.cstorch.utils.data.DataExecutor(loader, num_steps=1):
                self._traced_step(device_batch)
        except Exception as e:
            problem = cluster_problem(e)
            if problem is None:
                raise translate(e) from e
            mlir = self.lowered()
            run.log.info("cerebras_lowered", mlir=[str(p) for p in mlir])
            where = f"the lowered graph is in {mlir[0].parent}" if mlir else "nothing was lowered"
            raise ConfigError(f"cerebras.mgmt_address: {'compile_only' if self.compile_only else 'validate_only'} "
                              f"traced the step locally ({where}); compiling it needs the cluster, which is not "
                              f"set ({problem}): set cerebras.mgmt_address=HOST:PORT") from e
        run.log.info("cerebras_validated" if self.validate_only else "cerebras_compiled",
                     mlir=[str(p) for p in self.lowered()])

    def lowered(self) -> list[Path]:
        """The MLIR files cstorch wrote into the run directory (``cerebras/executors/<n>/*.mlir``)."""
        return sorted(self.artifact_dir.glob("executors/[0-9]*/*.mlir"))

    def summary(self) -> dict:
        return {"traces": self.traces, "cerebras": {"type": self.kind, "artifact_dir": str(self.artifact_dir),
                                                    "mlir": [str(p) for p in self.lowered()]}}


class _Compiled(torch.nn.Module):
    """What the steps call (``run.module``): the model's ``cstorch.compile``d forward, with the model's
    ``training`` flag, ``train()`` and ``eval()``."""

    def __init__(self, model, forward):
        super().__init__()
        self.model = model
        self._forward = forward

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)


def cluster_config(cstorch, cfg):
    """``cstorch.distributed.ClusterConfig`` from the ``cerebras`` section and ``backend.num_csx`` ..."""
    c, b = cfg.cerebras, cfg.backend
    return cstorch.distributed.ClusterConfig(
        mgmt_address=c.mgmt_address, mgmt_namespace=c.mgmt_namespace, credentials_path=c.credentials_path,
        num_csx=b.num_csx, num_workers_per_csx=b.num_workers_per_csx, mount_dirs=list(c.mount_dirs),
        python_paths=list(c.python_paths), job_labels=list(c.job_labels), job_priority=c.job_priority,
        job_time_sec=c.job_time_sec)


def _lowering_tools_on_path() -> None:
    """cstorch lowers the traced graph with ``torch-cirh-opt``, installed in the venv's ``bin/``, which is not
    on ``PATH`` when the venv's Python is run without activating the venv."""
    if shutil.which("torch-cirh-opt") is None:
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
