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

    def prepare(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        """Under dynamic loss scaling, let the optimizer skip an overflowing step on the device (again after
        a checkpoint is loaded, which brings back the saved settings): see ``skip_on_device``."""
        if self.scaler is not None:
            skip_on_device(optimizer, model)

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

#: torch's optimizers whose fused implementation takes ``GradScaler``'s overflow flag and skips the step itself
FUSED_SKIPPING = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def skip_on_device(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Run torch's SGD, Adam and AdamW fused where torch has fused kernels for the parameters' device, so that
    dynamic loss scaling never waits for the device: ``GradScaler.step`` hands a fused optimizer the overflow
    flag as a device tensor, and the kernel skips an overflowing step there (parameters, optimizer state and
    step count unchanged). With any other optimizer ``GradScaler.step`` reads the flag on the host to decide
    whether to call ``step()``: a synchronisation every step, as in a hand-written loop.

    Left alone: other classes (a subclass's ``step`` may ignore the flag), an implementation the user chose
    (``foreach``, ``fused=False``, ``differentiable``) and sparse gradients."""
    groups = optimizer.param_groups
    if (type(optimizer) not in FUSED_SKIPPING
            or any(g.get("foreach") or g.get("differentiable") or g.get("fused") is False for g in groups)
            or any(getattr(m, "sparse", False) is True for m in model.modules())):
        return
    try:  # the device types torch has fused optimizer kernels for (private, stable since torch 2.2)
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        supported = _get_fused_kernels_supported_devices()
    except ImportError:
        supported = ["cuda"]
    params = [p for g in groups for p in g["params"]]
    if not params or not all(p.is_floating_point() and p.device.type in supported for p in params):
        return
    for group in groups:
        group["fused"] = True
    # what the constructor sets for fused=True: GradScaler.step then hands the overflow flag to step()
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    # a fused kernel keeps the step count in float32 beside its parameter (a checkpoint of an unfused run has
    # it on the host)
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
