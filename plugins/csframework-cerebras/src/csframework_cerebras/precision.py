"""``precision`` mapped onto ``cstorch.amp``: the primitives of csframework's step (``step.PrecisionOps``).

- cstorch's CPU backend: ``float32``, or ``bfloat16`` under ``cstorch.amp.autocast`` (it refuses any other
  half dtype; ``config.py`` refuses them before launch).
- CSX: ``cstorch.amp.set_half_dtype`` (``bfloat16``, ``float16``, ``cbfloat16``): the compiler casts the
  graph; ``cstorch.amp.GradScaler`` scales the loss (``precision.loss_scaling=dynamic`` or a fixed number),
  unscales the gradients, skips the update of a step whose gradients overflow and adjusts the scale. cstorch
  runs every CSX step in mixed precision: with ``precision=float32`` its default half dtype (float16) is used.
"""
from __future__ import annotations

import contextlib

import torch

HALF = ("bfloat16", "float16", "cbfloat16")


class CstorchPrecision:
    """One run's precision on cstorch. ``attach`` makes the grad scaler, which cstorch sets up on the
    optimizers it knows, so after the cstorch optimizer exists."""

    def __init__(self, cstorch, cfg, kind: str):
        self.cstorch, self.cfg, self.kind = cstorch, cfg, kind
        self.name = cfg.name
        if cfg.name in HALF and kind == "CSX":
            cstorch.amp.set_half_dtype(cfg.name)
        self.autocast_dtype = torch.bfloat16 if cfg.name == "bfloat16" and kind == "CPU" else None
        self.scaler = None

    def attach(self) -> None:
        """The ``GradScaler`` of ``precision.loss_scaling`` (CSX; none without loss scaling)."""
        scaling = self.cfg.loss_scaling
        if scaling in (None, "none") or self.kind != "CSX":
            return
        self.scaler = self.cstorch.amp.GradScaler(
            loss_scale="dynamic" if scaling == "dynamic" else float(scaling), init_scale=self.cfg.init_scale,
            steps_per_increase=self.cfg.growth_interval)

    @property
    def dynamic(self) -> bool:
        return self.scaler is not None and self.scaler.dynamic

    # -- step.PrecisionOps --------------------------------------------------------------------------------
    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return self.cstorch.amp.autocast(self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, skip=None) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        if self.scaler is not None:
            self.scaler.update()

    # -- state ----------------------------------------------------------------------------------------------
    def scale_tensor(self):
        """The loss scale as the step leaves it (a tensor of the step, for a step closure), or ``None``."""
        return self.scaler.state_dict().get("loss_scale") if self.dynamic else None

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
