"""Precision policies: autocast for half-precision compute over float32 master weights, and loss scaling.

One small object per run: the eager backend's ``step.PrecisionOps`` (``autocast``, ``backward``,
``unscale``, ``optimizer_step``, ``update``), made by ``policy``. float32 without loss scaling is the null
object ``FLOAT32``, whose primitives do only the plain thing, so the step has one path for every policy.
"""
from __future__ import annotations

import contextlib

import torch

from .config import PrecisionConfig

HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
#: float32's forward context: one reusable ``nullcontext`` (made once, not at every step)
NO_AUTOCAST = contextlib.nullcontext()


class Precision:
    """Autocast + loss scaling for one device type (``cpu`` or ``cuda``)."""

    def __init__(self, cfg: PrecisionConfig, device_kind: str):
        self.name = cfg.name
        self.device_kind = device_kind
        self.dtype = HALF_DTYPES.get(cfg.name)
        scaling = cfg.loss_scaling
        self.scaler = None
        self.fixed_scale = None
        if scaling == "dynamic":
            self.scaler = torch.amp.GradScaler(device_kind, init_scale=cfg.init_scale,
                                               growth_interval=cfg.growth_interval)
        elif scaling not in (None, "none"):
            self.fixed_scale = float(scaling)

    def fused_optimizer(self, model: torch.nn.Module) -> bool:
        """Whether the stage's optimizer should be built fused: under dynamic loss scaling, so that an
        overflowing step is skipped on the device (``FUSED_SKIPPING``); not with sparse gradients, which
        torch's fused kernels do not take."""
        return self.scaler is not None and not any(getattr(m, "sparse", False) is True for m in model.modules())

    def prepare(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        """After a checkpoint is loaded: an optimizer built fused stays fused (``keep_fused``)."""
        keep_fused(optimizer)

    def autocast(self):
        if self.dtype is None:
            return NO_AUTOCAST
        return torch.autocast(self.device_kind, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        elif self.fixed_scale is not None:
            (loss * self.fixed_scale).backward()
        else:
            loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to true scale (before clipping and ``on_before_optimizer_step``). The
        ``GradScaler`` remembers an overflow itself, so there is nothing to return."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        elif self.fixed_scale is not None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch._foreach_mul_(grads, 1.0 / self.fixed_scale)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, skip: None = None) -> None:
        """Optimizer step; under dynamic scaling a step with non-finite gradients is skipped."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


class Float32:
    """float32 without loss scaling: the null policy (no autocast, an unscaled backward, a plain step)."""

    name, dtype, scaler, fixed_scale = "float32", None, None, None

    @staticmethod
    def fused_optimizer(model: torch.nn.Module) -> bool:
        return False

    @staticmethod
    def prepare(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        return None

    @staticmethod
    def autocast():
        return NO_AUTOCAST

    @staticmethod
    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    @staticmethod
    def unscale(optimizer: torch.optim.Optimizer) -> None:
        return None

    @staticmethod
    def optimizer_step(optimizer: torch.optim.Optimizer, skip: None = None) -> None:
        optimizer.step()

    @staticmethod
    def update() -> None:
        return None

    @staticmethod
    def state_dict() -> dict:
        return {}

    @staticmethod
    def load_state_dict(state: dict) -> None:
        return None


FLOAT32 = Float32()

#: torch's optimizers whose fused implementation takes ``GradScaler``'s overflow flag and skips the step itself:
#: the built-in ``sgd``, ``adam`` and ``adamw`` are built with ``fused=True`` under dynamic loss scaling
#: (``Precision.fused_optimizer``), so that ``GradScaler.step`` hands the kernel the flag as a device tensor
#: instead of reading it on the host (a synchronisation every step, as in a hand-written loop with any other
#: optimizer, or with ``_target_`` ones unless their ``args.fused=true``).
FUSED_SKIPPING = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def keep_fused(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer built fused stays fused after ``load_state_dict``, which brings back the settings a
    checkpoint was saved with (``fused: None`` from an unfused run): the groups are fused again and each step
    count is where a fused kernel keeps it (float32, beside its parameter)."""
    if not (isinstance(optimizer, FUSED_SKIPPING) and optimizer.defaults.get("fused")):
        return
    for group in optimizer.param_groups:
        group["fused"] = True
    for param, state in optimizer.state.items():
        count = state.get("step") if isinstance(state, dict) else None
        if isinstance(count, torch.Tensor) and (count.device != param.device or count.dtype != torch.float32):
            state["step"] = count.to(param.device, torch.float32)


def policy(cfg: PrecisionConfig, device_kind: str) -> Precision | Float32:
    """The precision policy of ``cfg`` on ``device_kind`` (``cpu`` or ``cuda``): ``FLOAT32`` when it does
    nothing, else a ``Precision``."""
    if HALF_DTYPES.get(cfg.name) is None and cfg.loss_scaling in (None, "none"):
        return FLOAT32
    return Precision(cfg, device_kind)
