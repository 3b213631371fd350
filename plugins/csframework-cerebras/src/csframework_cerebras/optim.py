"""The built-in optimizers and learning-rate schedules mapped onto ``cerebras.pytorch.optim`` (the validation
rules of ``config.py`` refused everything else before launch)."""
from __future__ import annotations

from csframework.schedule import TargetSchedule

from .config import OPTIMIZERS


def build_optimizer(cstorch, model, cfg):
    """The cstorch optimizer of the ``optimizer`` group: ``cstorch.optim.SGD``, ``Adam`` or ``AdamW`` with
    the group's settings (its state is preinitialized by cstorch before the first trace)."""
    name = OPTIMIZERS[cfg._target_] if cfg._target_ else getattr(cfg.name, "value", cfg.name)
    name = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}.get(name, name)
    params = model.parameters()
    if name == "SGD":
        return cstorch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum or 0.0, weight_decay=cfg.weight_decay,
                                 nesterov=bool(cfg.nesterov))
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.betas is not None:
        kwargs["betas"] = tuple(cfg.betas)
    if cfg.eps is not None:
        kwargs["eps"] = cfg.eps
    return getattr(cstorch.optim, name)(params, **kwargs)


def build_schedule(cstorch, optimizer, cfg, total_steps: int) -> TargetSchedule:
    """csframework's built-in schedule as ``cstorch.optim.lr_scheduler`` objects, stepped after every step.

    csframework's rate at step ``s`` (0-based) is ``lr * (s + 1) / warmup`` during the warm-up, then constant,
    or a linear or cosine decay reaching ``min_lr`` at the last step (``csframework.schedule.lr_factor``):
    a ``LinearLR`` from ``lr / warmup`` to ``lr`` over ``warmup - 1`` steps, then ``ConstantLR``,
    ``LinearLR`` or ``CosineDecayLR`` over the rest, joined by ``SequentialLR``."""
    sched = cfg.schedule
    lr, warmup = cfg.lr, sched.warmup_steps
    kind = getattr(sched.name, "value", sched.name)
    lrs = cstorch.optim.lr_scheduler
    decay_steps = max(1, total_steps - warmup - 1)
    if kind == "constant" or lr == 0:
        main = lrs.ConstantLR(optimizer, learning_rate=lr)
    elif kind == "linear":
        main = lrs.LinearLR(optimizer, initial_learning_rate=lr, end_learning_rate=sched.min_lr,
                            total_iters=decay_steps)
    else:
        main = lrs.CosineDecayLR(optimizer, initial_learning_rate=lr, end_learning_rate=sched.min_lr,
                                 total_iters=decay_steps)
    if warmup <= 0:
        return TargetSchedule(main, per_epoch=False)
    if warmup == 1:
        ramp = lrs.ConstantLR(optimizer, learning_rate=lr)
    else:
        ramp = lrs.LinearLR(optimizer, initial_learning_rate=lr / warmup, end_learning_rate=lr,
                            total_iters=warmup - 1)
    return TargetSchedule(lrs.SequentialLR(optimizer, schedulers=[ramp, main], milestones=[warmup]), per_epoch=False)
