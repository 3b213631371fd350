"""Precision inside a traced step's graph: half-precision compute and loss scaling as graph operations.

* ``float32``: nothing.
* ``bfloat16`` / ``float16``: autocast while tracing (the casts become graph operations), as eagerly.
* Loss scaling (``dynamic`` or a number) is part of the graph, with ``GradScaler``'s arithmetic and state:
  the scale multiplies the loss, gradients are unscaled with an overflow check, a step whose gradients are not
  finite is skipped with ``torch.where`` (no host synchronisation) and the scale is updated in the graph.

``GraphPrecision`` is the ``step.PrecisionOps`` of a traced (or compiled) step: the compile path of the CPU/GPU
backend uses it as it is, the CSX emulator adds its cbfloat16 compute on top (``backends/csx/precision.py``).
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from ..config import PrecisionConfig
from ..precision import HALF_DTYPES
from . import optim as graph_optim


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
        self._found_inf: torch.Tensor | None = None  # the last unscale's overflow count, for update

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
        if self.fixed is not None:
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
        if self.dynamic and self._found_inf is not None:
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


class GraphPrecision:
    """The precision policy of a traced step: autocast to a half precision, loss scaling in the graph."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.name = cfg.name
        self.device = device
        self.dtype = HALF_DTYPES.get(cfg.name)
        self.scaler = GraphLossScaler(cfg, device)

    def autocast(self) -> AbstractContextManager:
        """The context the forward pass is traced in."""
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
        graph_optim.step(optimizer, skip=skip)

    def update(self) -> None:
        self.scaler.update()
