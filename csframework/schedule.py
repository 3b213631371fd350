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


class Schedule:
    """Writes ``base_lr * lr_factor(step)`` into each param group before every optimizer step.

    The interface of a torch ``LRScheduler`` that code uses (``step``, ``get_last_lr``, ``last_epoch``,
    ``base_lrs``, ``state_dict``, ``load_state_dict``) without its per-step bookkeeping, which costs
    more than the rest of the loop on a small model. ``last_epoch`` counts optimizer steps, as in torch.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
        self.optimizer, self.cfg, self.total_steps = optimizer, cfg, total_steps
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_epoch = 0
        self._apply()

    def step(self) -> None:
        """Called once after each optimizer step: set the rate of the next one."""
        self.last_epoch += 1
        self._apply()

    def _apply(self) -> None:
        factor = lr_factor(self.last_epoch, self.cfg, self.total_steps)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def get_last_lr(self) -> list[float]:
        """The rate of each param group for the next optimizer step."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        """Also reads a torch ``LambdaLR`` state (it has the same two keys)."""
        self.last_epoch, self.base_lrs = int(state["last_epoch"]), list(state["base_lrs"])
        self._apply()


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int) -> Schedule:
    """The schedule of ``cfg.schedule`` for ``total_steps`` optimizer steps (stepped once per step)."""
    return Schedule(optimizer, cfg, total_steps)


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
