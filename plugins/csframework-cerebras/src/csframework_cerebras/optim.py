"""The built-in optimizers and learning-rate schedules mapped onto ``cerebras.pytorch.optim`` (the validation
rules of ``config.py`` refused everything else before launch)."""
from __future__ import annotations

import warnings

from .config import OPTIMIZERS


def build_optimizer(cstorch, param_groups, cfg):
    """The cstorch optimizer of the ``optimizer`` group: ``cstorch.optim.SGD``, ``Adam`` or ``AdamW`` with
    the group's settings (its state is preinitialized by cstorch before the first trace), over the run's
    parameter groups (``run.param_groups``: ``optimizer.groups``, ``optimizer.weight_decay_exclude``)."""
    from csframework.param_groups import optimizer_params

    name = OPTIMIZERS[cfg._target_] if cfg._target_ else getattr(cfg.name, "value", cfg.name)
    name = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}.get(name, name)
    # torch's param-group dicts (params, and the lr / weight_decay a group differs in), without the name
    params = [{k: v for k, v in group.items() if k != "name"}
              for group in optimizer_params(param_groups, cfg.lr, cfg.weight_decay)]
    if name == "SGD":
        return cstorch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum or 0.0, weight_decay=cfg.weight_decay,
                                 nesterov=bool(cfg.nesterov))
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.betas is not None:
        kwargs["betas"] = tuple(cfg.betas)
    if cfg.eps is not None:
        kwargs["eps"] = cfg.eps
    return getattr(cstorch.optim, name)(params, **kwargs)


class InStepSchedule:
    """The cstorch schedule behind csframework's schedule interface (``run.scheduler``). cstorch computes the
    rate inside the traced step (in the graph, on CSX), so the bridge steps it there, after the optimizer
    (``advance``); the loop's ``step`` after the step then has nothing left to do. Its state goes into
    checkpoints as any schedule's."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def advance(self) -> None:
        """Step the schedule (inside the traced step, after the optimizer step)."""
        with warnings.catch_warnings():  # cstorch counts an optimizer step skipped by the grad scaler too
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()

    def step(self) -> None:
        pass

    def epoch_end(self) -> None:
        pass

    def get_last_lr(self) -> list:
        return [float(v) for v in self.scheduler.get_last_lr()]

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


def build_schedule(cstorch, optimizer, cfg, total_steps: int) -> InStepSchedule:
    """csframework's built-in schedule as ``cstorch.optim.lr_scheduler`` objects, stepped in every step.

    csframework's rate at step ``s`` (0-based) is ``lr * (s + 1) / warmup`` during the warm-up, then constant,
    or a linear or cosine decay reaching the final rate (``final_lr``) at the last step
    (``csframework.schedule.lr_factor``):
    a ``LinearLR`` from ``lr / warmup`` to ``lr`` over ``warmup - 1`` steps, then ``ConstantLR``,
    ``LinearLR`` or ``CosineDecayLR`` over the rest, joined by ``SequentialLR``."""
    from csframework.config.optimizer import final_lr

    sched = cfg.schedule
    lr, warmup = cfg.lr, sched.warmup_steps
    kind = getattr(sched.name, "value", sched.name)
    lrs = cstorch.optim.lr_scheduler
    decay_steps = max(1, total_steps - warmup - 1)
    if kind == "constant" or lr == 0:
        main = lrs.ConstantLR(optimizer, learning_rate=lr)
    elif kind == "linear":
        main = lrs.LinearLR(optimizer, initial_learning_rate=lr, end_learning_rate=final_lr(cfg),
                            total_iters=decay_steps)
    else:
        main = lrs.CosineDecayLR(optimizer, initial_learning_rate=lr, end_learning_rate=final_lr(cfg),
                                 total_iters=decay_steps)
    if warmup <= 0:
        return InStepSchedule(main)
    if warmup == 1:
        ramp = lrs.ConstantLR(optimizer, learning_rate=lr)
    else:
        ramp = lrs.LinearLR(optimizer, initial_learning_rate=lr / warmup, end_learning_rate=lr,
                            total_iters=warmup - 1)
    return InStepSchedule(lrs.SequentialLR(optimizer, schedulers=[ramp, main], milestones=[warmup]))
