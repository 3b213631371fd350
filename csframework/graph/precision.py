"""Precision on CSX: half-precision compute inside the traced step and loss scaling as graph operations.

* ``float32``: nothing.
* ``bfloat16`` / ``float16``: autocast while tracing (the casts become graph operations), as on CPU/GPU.
* ``cbfloat16``: every matrix product, convolution and attention (the operations the wafer runs in half
  precision) takes CB16-rounded inputs and gives a CB16-rounded result; in the backward pass the gradient
  flowing through the same boundary is CB16-rounded too. Master weights and optimizer state stay float32.
* Loss scaling (``dynamic`` or a number) is part of the graph, with ``GradScaler``'s arithmetic and state:
  the scale multiplies the loss, gradients are unscaled with an overflow check, a step whose gradients are not
  finite is skipped with ``torch.where`` (no host synchronisation) and the scale is updated in the graph.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..config import PrecisionConfig
from ..precision import HALF_DTYPES
from . import optim as csx_optim
from ..backends.csx.cbfloat16 import round_to_cbfloat16



class _CB16Compute(torch.autograd.Function):
    """CB16 rounding at a compute boundary: the value forward, the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.dtype = x.dtype
        return round_to_cbfloat16(x).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return round_to_cbfloat16(grad).to(ctx.dtype)


def cb16(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return _CB16Compute.apply(x)
    if isinstance(x, (list, tuple)):
        return type(x)(cb16(v) for v in x)
    return x


_CB16_OPS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
             torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm,
             torch.baddbmm, torch.Tensor.baddbmm, torch.einsum, F.conv1d, F.conv2d, F.conv3d,
             F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.scaled_dot_product_attention,
             F.bilinear}


class CB16ComputeMode(TorchFunctionMode):
    """Rounds the inputs and outputs of the half-precision compute operations to CB16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CB16_OPS:
            args = tuple(cb16(a) for a in args)
            kwargs = {k: cb16(v) for k, v in kwargs.items()}
            return cb16(func(*args, **kwargs))
        return func(*args, **kwargs)


class GraphLossScaler:
    """Loss scaling inside the graph. ``scale`` and ``growth_tracker`` are state tensors (graph inputs
    updated in place); the state dict uses ``torch.amp.GradScaler``'s keys."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.dynamic = cfg.loss_scaling == "dynamic"
        fixed = cfg.loss_scaling not in (None, "none", "dynamic")
        self.enabled = self.dynamic or fixed
        self.fixed = float(cfg.loss_scaling) if fixed else None
        init = float(cfg.init_scale) if self.dynamic else (self.fixed or 1.0)
        self.scale = torch.full((), init, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor = 2.0, 0.5
        self.growth_interval = int(cfg.growth_interval)

    def state_attrs(self) -> list[tuple]:
        """The tensors the graph reads and updates, for the tracer's state collection."""
        return [(self, "scale", "loss_scale"), (self, "growth_tracker", "loss_scale")] if self.enabled else []

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale(self, params) -> torch.Tensor | None:
        """Unscale the gradients in place; returns the overflow flag (bool tensor) under dynamic scaling."""
        if not self.enabled:
            return None
        grads = [p.grad for p in params if p.grad is not None]
        if not self.dynamic:
            torch._foreach_mul_(grads, 1.0 / self.fixed)
            return None
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        by_device: dict = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for group in by_device.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        self._found_inf = found_inf
        return found_inf > 0

    def update(self) -> None:
        if self.dynamic:
            torch._amp_update_scale_(self.scale, self.growth_tracker, self._found_inf, self.growth_factor,
                                     self.backoff_factor, self.growth_interval)
            self._found_inf = None

    def state_dict(self) -> dict:
        if not self.dynamic:
            return {}
        return {"scale": float(self.scale), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        if self.dynamic and state:
            self.scale.fill_(float(state["scale"]))
            self.growth_tracker.fill_(int(state.get("_growth_tracker", 0)))


class CsxPrecision:
    """The precision policy of a CSX run."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.name = cfg.name
        self.device = device
        self.dtype = HALF_DTYPES.get(cfg.name)
        self.scaler = GraphLossScaler(cfg, device)

    def autocast(self):
        """The context the forward pass is traced in."""
        if self.name == "cbfloat16":
            return CB16ComputeMode()
        if self.dtype is not None:
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    # -- the primitives of ``step.PrecisionOps``, traced into the step's graph -------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Unscale in the graph; returns the overflow flag the optimizer step obeys."""
        return self.scaler.unscale([p for g in optimizer.param_groups for p in g["params"]])

    def optimizer_step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor | None) -> None:
        csx_optim.step(optimizer, skip=skip)

    def update(self) -> None:
        self.scaler.update()
