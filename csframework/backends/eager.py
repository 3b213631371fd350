"""Eager execution on CPU or CUDA, single process or DDP (``backend.strategy``), any precision policy."""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from ..data import move_to
from ..precision import Precision


def model_outputs(out) -> dict:
    """The model contract: a loss tensor, or a dict with ``loss``."""
    if isinstance(out, torch.Tensor):
        return {"loss": out}
    if isinstance(out, dict) and "loss" in out:
        return out
    raise TypeError("model.forward(batch) must return the loss tensor or a dict with a 'loss' key, "
                    f"got {type(out).__name__}" + (f" with keys {sorted(out)}" if isinstance(out, dict) else ""))


def detached(outputs: dict) -> dict:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in outputs.items()}


#: How long ``finish`` waits for the pending stop-agreement all-reduce at the end of a stage or fit.
FINISH_WAIT_S = 30


class EagerBackend:
    """CPU/GPU. ``train_batch`` does forward, backward and, on the last batch of a step, the optimizer step."""

    def __init__(self, run):
        cfg = run.stage_config
        self.kind = cfg.device.type
        backend = cfg.backend
        self.distributed = getattr(backend.strategy, "value", backend.strategy) == "ddp"
        if self.kind == "GPU":
            if not torch.cuda.is_available():
                raise RuntimeError("device=gpu: CUDA is not available on this machine; use device=cpu")
            index = int(os.environ.get("LOCAL_RANK", 0)) if self.distributed else (backend.device_index or 0)
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if backend.threads:
            torch.set_num_threads(backend.threads)
        self.precision = Precision(cfg.precision, self.device.type)
        self.max_grad_norm = cfg.optimizer.max_grad_norm
        self.accum = cfg.loop.grad_accum_steps
        self.rank, self.world_size = 0, 1
        if self.distributed:
            if not dist.is_initialized():
                dist.init_process_group("nccl" if self.kind == "GPU" else "gloo")
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            # host-side flags travel over gloo: no device synchronisation for them under NCCL
            self.host_group = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
        self._signal_flag = None  # (tensor, pending all-reduce) of any_rank_signal

    def any_rank_signal(self, signum: int | None) -> int | None:
        """The stop signal any rank had received one step ago, the same on every rank (all ranks must stop
        after the same step, or the others would wait forever in the next gradient all-reduce).

        Called at every step boundary with this rank's signal: it reads the small all-reduce started at the
        previous boundary and starts the next, so the collective runs while the step computes.
        """
        agreed = None
        if self._signal_flag is not None:
            self._signal_flag[1].wait()
            agreed = int(self._signal_flag[0].item()) or None
        flag = torch.tensor([signum or 0], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.host_group, async_op=True)
        self._signal_flag = (flag, work)
        return agreed

    def finish(self) -> None:
        """Wait (bounded) for the stop-agreement all-reduce still in flight; the run's stage or fit ended.
        Every rank started it at the same step boundary, so it completes unless a rank has died."""
        pending, self._signal_flag = self._signal_flag, None
        if pending is None:
            return
        try:
            pending[1].wait(datetime.timedelta(seconds=FINISH_WAIT_S))
        except RuntimeError:  # a rank died or hangs: nothing to agree on any more
            pass

    def broadcast(self, value):
        """Rank 0's ``value`` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- assembly -----------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to the device; returns the module to call (a DDP wrapper under ``ddp``)."""
        model.to(self.device)
        if self.distributed and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            ids = [self.device.index] if self.device.type == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model

    def to_device(self, batch):
        if self.device.type == "cpu":
            return batch
        return move_to(batch, self.device, non_blocking=True)

    # -- steps --------------------------------------------------------------------------------------------
    def train_batch(self, run, batch, last: bool) -> dict:
        module, hooks, precision = run.module, run.hooks, self.precision
        sync = contextlib.nullcontext() if (last or not self.distributed) else module.no_sync()
        with sync:
            with precision.autocast():
                outputs = model_outputs(module(batch))
            loss = outputs["loss"]
            hooks.on_before_backward(run=run, loss=loss)
            precision.backward(loss / self.accum if self.accum > 1 else loss)
        hooks.on_after_backward(run=run)
        if last:
            optimizer = run.optimizer
            precision.unscale(optimizer)
            hooks.on_before_optimizer_step(run=run, optimizer=optimizer)
            if self.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(run.model.parameters(), self.max_grad_norm)
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            run.scheduler.step()
        return detached(outputs)

    @torch.no_grad()
    def eval_batch(self, run, batch) -> dict:
        with self.precision.autocast():
            return detached(model_outputs(run.module(batch)))

    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (one synchronisation), or ``None`` without dynamic scaling."""
        scaler = self.precision.scaler
        return scaler.get_scale() if scaler is not None else None

    def state_dict(self) -> dict:
        return {"precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.precision.load_state_dict(state.get("precision", {}))

    def summary(self) -> dict:
        return {}
