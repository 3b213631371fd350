"""``CerebrasBackend``: a csframework run on cerebras-pytorch (cstorch).

The model goes through ``cstorch.compile``, the optimizer and schedule are their ``cstorch.optim``
equivalents (``optim.py``), the precision is ``cstorch.amp``'s (``precision.py``), and the train step,
csframework's own sequence (``csframework.step``) followed by the schedule, runs under ``@cstorch.trace``; so
does the evaluation step, on the compiled model. Each step runs inside a ``cstorch.utils.data.DataExecutor``
(``executor.py``), and its values come back as cstorch hands them out: the outputs (and the loss scale)
through a ``@cstorch.step_closure``, the model's and optimizer's state through a
``@cstorch.checkpoint_closure`` on the executor's checkpoint steps (the steps csframework's checkpoint
plugin saves at), which the plugin then writes (``checkpoint_state``: atomic, checksummed, ``keep_last``,
``resume=auto``).

With ``backend.type=CPU`` cstorch runs the steps eagerly, on csframework's batches. ``compile_only`` /
``validate_only`` (type CSX) trace one step on cstorch's lazy device and lower it locally; what needs the
cluster then ends the run with one line naming ``cerebras.mgmt_address``.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from csframework import step
from csframework.backends.base import BackendBase
from csframework.errors import CheckpointWriteError, ConfigError

from .data import input_fn, loader_args, val_input_fn
from .errors import cluster_problem, lowering_error, translate
from .executor import Steps, checkpoint_schedule
from .optim import build_optimizer, build_schedule
from .precision import CstorchPrecision


def import_cstorch():
    """``cerebras.pytorch``, or a ``ConfigError`` saying how to install it."""
    try:
        import cerebras.pytorch as cstorch
    except ImportError as e:
        raise ConfigError(f"backend=cerebras: cerebras.pytorch cannot be imported ({e}); install it in its own venv: "
                          "pip install 'csframework-cerebras[cstorch]' (it pins torch==2.4.0)") from e
    return cstorch


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
        self.precision = CstorchPrecision(cstorch, cfg.precision, self.kind)
        self.warnings: list[tuple[str, dict]] = []  # logged when the run starts (the plugin's on_fit_start)
        if self.kind == "CSX" and cfg.precision.name == "float32":
            self.warnings.append(("cerebras_mixed_precision", dict(
                precision="float32", half_dtype="float16",
                problem="cstorch computes every CSX step in mixed precision: with precision=float32 its default "
                        "half dtype (float16) is used, without loss scaling",
                fix="set precision=bfloat16, or float16/cbfloat16 with precision.loss_scaling=dynamic")))
        self.traces = 0  # how often the train step's Python ran: once on CSX, or every step (CPU, retracing)
        self.eval_traces = 0
        self.fetches = 0  # states the checkpoint closure fetched
        self.run = None
        self.steps = Steps(cstorch, self.cs)
        self._delivered: dict | None = None
        self._scale = None  # the loss scale the last step left (dynamic loss scaling)
        self._step_number = 0  # the global step the running train step makes
        self._fetched: tuple | None = None  # (global step, model state, optimizer state, precision state)
        self._deliver = cstorch.step_closure(self._store)
        self._fetch_state = cstorch.checkpoint_closure(self._fetch)
        self._traced_step = cstorch.trace(self._step)
        self._traced_eval = cstorch.trace(self._eval_step)

    # -- assembly ---------------------------------------------------------------------------------------
    def prepare_model(self, model):
        return _Compiled(model, self.cstorch.compile(model, self.cs))

    def attach(self, run) -> None:
        """Replace the run's torch optimizer and schedule by their cstorch equivalents, and make the grad
        scaler (cstorch sets it up on the optimizers it knows)."""
        self.run = run
        cfg = run.stage_config
        run.optimizer = build_optimizer(self.cstorch, run.param_groups, cfg.optimizer)
        run.scheduler = build_schedule(self.cstorch, run.optimizer, cfg.optimizer, run.total_steps(cfg))
        self.precision.attach()

    # -- the traced steps ---------------------------------------------------------------------------------
    def _store(self, outputs, scale) -> None:
        """Step closure: the step's values, as cstorch hands them out after the step."""
        self._delivered, self._scale = outputs, scale

    def _fetch(self) -> None:
        """Checkpoint closure: the model's, optimizer's and grad scaler's state at a checkpoint step, in
        host memory (on a cluster the weights can be fetched only on these steps). The step is read when it
        runs: on a cluster the closures registered by the first trace repeat at every step."""
        run, cs = self.run, self.cs

        def host(tree):
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: cs.to_cpu(t).clone(), tree)

        self._fetched = (self._step_number, host(run.model.state_dict()), host(run.optimizer.state_dict()),
                         host(self.precision.state_dict()))
        self.fetches += 1

    def _handable(self, outputs: dict) -> dict:
        """``outputs`` as a step closure can receive them: on CSX the half-precision ones in float32 (a
        cbfloat16 tensor has no host representation)."""
        if self.kind != "CSX":
            return outputs
        return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in outputs.items()}

    def _step(self, batch):
        self.traces += 1
        run = self.run
        outputs = step.train_step(run, self.precision, run.module, [batch], self.max_grad_norm)
        run.scheduler.advance()
        self._deliver(self._handable(outputs), self.precision.scale_tensor())
        self._fetch_state()

    def _eval_step(self, batch):
        self.eval_traces += 1
        with self.precision.autocast():
            outputs = step.model_outputs(self.run.module(batch))
        self._deliver(self._handable(step.detached(outputs)), None)

    # -- steps ------------------------------------------------------------------------------------------
    def train_batch(self, run, batch, last: bool) -> dict:
        self._step_number = run.global_step + 1
        cfg = run.stage_config
        self._delivered = None
        try:
            device_batch = self.steps.begin(
                "train", batch, lambda: self._segment(run), loader=self._cluster_loader(run),
                checkpoint_steps=lambda n: checkpoint_schedule(
                    self.cstorch, self._step_number, n, cfg.checkpoint.every_steps,
                    stage_end=run.stage_step + n >= run.total_steps(cfg)))
            self._traced_step(device_batch)
            self.steps.end()
        except Exception as e:
            raise translate(e) from e
        return self._delivered

    def _segment(self, run) -> int:
        """The steps of a train executor opened now: to the next evaluation or the stage's end."""
        cfg = run.stage_config
        steps = max(1, run.total_steps(cfg) - run.stage_step)
        every = cfg.loop.eval_every
        if every and run.val_loader is not None:
            steps = min(steps, every - run.stage_step % every)
        return steps

    def _cluster_loader(self, run):
        """On a cluster: a DataLoader whose input function the input workers call (``data.py``)."""
        if self.kind != "CSX":
            return None
        return lambda feed: self.cstorch.utils.data.DataLoader(input_fn, *loader_args(run))

    def eval_batch(self, run, batch) -> dict:
        self._delivered = None
        try:
            device_batch = self.steps.begin("eval", batch, lambda: self._eval_length(run),
                                            loader=self._cluster_val_loader(run))
            self._traced_eval(device_batch)
            self.steps.end()
        except Exception as e:
            raise translate(e) from e
        return self._delivered

    @staticmethod
    def _eval_length(run) -> int:
        """The batches of an evaluation (``loop.eval_steps`` at most), for its executor."""
        limit = run.stage_config.loop.eval_steps
        try:
            batches = len(run.val_loader)
        except TypeError:  # an IterableDataset: until the loop stops asking (the executor is closed then)
            batches = limit or 2**31 - 1
        return max(1, min(batches, limit) if limit else batches)

    def _cluster_val_loader(self, run):
        if self.kind != "CSX":
            return None
        data, seed, _, _ = loader_args(run)
        return lambda feed: self.cstorch.utils.data.DataLoader(val_input_fn, data, seed)

    def finish(self) -> None:
        """End cstorch's run context (the open executor)."""
        self.steps.close()

    # -- checkpoints --------------------------------------------------------------------------------------
    def checkpoint_state(self, model, optimizer) -> tuple[dict, dict]:
        """What the checkpoint closure fetched at this step; at a step that is not one of cstorch's
        checkpoint steps (a stop signal's), cstorch's CPU backend has the state in host memory, a cluster
        has not handed it out."""
        fetched = self._fetched
        if fetched is not None and fetched[0] == self.run.global_step:
            return fetched[1], fetched[2]
        if self.kind == "CPU":
            return model.state_dict(), optimizer.state_dict()
        raise CheckpointWriteError(f"checkpoint: step {self.run.global_step} is not a checkpoint step of cstorch's "
                                   "executor, and the cluster hands out the weights only there; the previous "
                                   "checkpoints are intact (they are saved every checkpoint.every_steps steps)")

    def state_dict(self) -> dict:
        fetched = self._fetched
        if fetched is not None and fetched[0] == self.run.global_step:
            return {"precision": fetched[3]}
        return {"precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.precision.load_state_dict(state.get("precision", {}))

    def loss_scale(self) -> float | None:
        """The dynamic loss scale the last step left (handed out by the step closure)."""
        return float(self._scale) if self.precision.dynamic and self._scale is not None else None

    # -- compile_only / validate_only -------------------------------------------------------------------
    def dry_stage(self, run) -> None:
        """Trace one step on cstorch's lazy device and lower it locally (``compile_only``), or validate it
        (``validate_only``); what needs the cluster ends the run naming ``cerebras.mgmt_address``."""
        # the cluster's input workers build the loader themselves: a picklable input function (data.py)
        loader = self.cstorch.utils.data.DataLoader(input_fn, *loader_args(run))
        self._step_number = run.global_step + 1
        try:
            for device_batch in self.cstorch.utils.data.DataExecutor(loader, num_steps=1):
                self._traced_step(device_batch)
        except Exception as e:
            problem = cluster_problem(e)
            if problem is None:
                raise translate(e) from e
            self._check_lowered()
            mlir = self.lowered()
            run.log.info("cerebras_lowered", mlir=[str(p) for p in mlir])
            where = f"the lowered graph is in {mlir[0].parent}" if mlir else "nothing was lowered"
            raise ConfigError(f"cerebras.mgmt_address: {'compile_only' if self.compile_only else 'validate_only'} "
                              f"traced the step locally ({where}); compiling it needs the cluster, which is not "
                              f"set ({problem}): set cerebras.mgmt_address=HOST:PORT") from e
        self._check_lowered()
        mlir = self.lowered()
        if self.validate_only:
            cirh = next((p for p in mlir if p.name == "cirh.mlir"), None)
            run.log.info("validate_only", ops=_cirh_ops(cirh), lowered=str(cirh.parent) if cirh else None,
                         result="cstorch traced the step on its lazy device and lowered it to Cerebras IR (CIRH) "
                                "locally; nothing was compiled for the wafer or executed")
        else:
            run.log.info("cerebras_compiled", mlir=[str(p) for p in mlir])

    def _check_lowered(self) -> None:
        """Raise the lowering failure cstorch reported only in a file (``errors.lowering_error``)."""
        executors = sorted(self.artifact_dir.glob("executors/[0-9]*"))
        problem = lowering_error(executors[-1]) if executors else None
        if problem is not None:
            raise problem

    def lowered(self) -> list[Path]:
        """The MLIR files cstorch wrote into the run directory (``cerebras/executors/<n>/*.mlir``)."""
        return sorted(self.artifact_dir.glob("executors/[0-9]*/*.mlir"))

    def summary(self) -> dict:
        return {"traces": self.traces, "eval_traces": self.eval_traces,
                "cerebras": {"type": self.kind, "artifact_dir": str(self.artifact_dir),
                             "executors": self.steps.executors, "checkpoint_fetches": self.fetches,
                             "precision": self.precision.name,
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


def _cirh_ops(path: Path | None) -> int | None:
    """The operations of a lowered CIRH graph (``cirh.mlir``), one a line."""
    if path is None:
        return None
    return sum(1 for line in path.read_text(errors="replace").splitlines() if " cirh." in line)


def cluster_config(cstorch, cfg):
    """``cstorch.distributed.ClusterConfig`` from the ``cerebras`` section and ``backend.num_csx`` ..."""
    c, b = cfg.cerebras, cfg.backend
    try:
        return _cluster_config(cstorch, c, b)
    except (TypeError, ValueError) as e:  # cstorch's own checks of the settings (validation ran before)
        raise ConfigError(f"cerebras: cstorch's ClusterConfig refused the settings: {e}") from e


def _cluster_config(cstorch, c, b):
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
