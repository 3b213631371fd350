"""Learning-rate schedules as a pure function of the step, so eager and traced (CSX) runs share them."""
from __future__ import annotations

import math

import torch

from .config import OptimizerConfig


def lr_factor(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """The multiplier of ``cfg.lr`` used by optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` (the first step already uses ``1/warmup_steps``), then constant,
    or a linear or cosine decay reaching ``min_lr`` at the last step.
    """
    sched = cfg.schedule
    warmup = sched.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    name = getattr(sched.name, "value", sched.name)
    if name == "constant" or cfg.lr == 0:
        return 1.0
    floor = sched.min_lr / cfg.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup - 1))
    if name == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
    """A ``LambdaLR`` following ``lr_factor`` (stepped once per optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The torch optimizer named by ``cfg.name`` with the settings it understands."""
    name = getattr(cfg.name, "value", cfg.name)
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               momentum=cfg.momentum or 0.0, nesterov=bool(cfg.nesterov))
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.betas is not None:
        kwargs["betas"] = tuple(cfg.betas)
    if cfg.eps is not None:
        kwargs["eps"] = cfg.eps
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, **kwargs)
