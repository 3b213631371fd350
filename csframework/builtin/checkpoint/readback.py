"""The rules each value of a checkpoint's state must pass (``schema.FIELDS`` names a field's rule), the ones
the config itself must pass (docs/durability.md, "Derived, not believed"): a checkpoint is untrusted input,
and its checksums prove only that its writer was consistent, not that it was csframework. A value the
config would refuse (a non-finite loss scale, a negative learning rate, a position past the end of its
stage) makes the checkpoint damaged, so resume falls back to an older one, naming it, instead of training on
the forged value.
"""
from __future__ import annotations

import math

import torch

from ...config.optimizer import ScheduleName
from ...config.ranges import MAX_COUNT, MAX_FLOAT32, MAX_GROWTH_INTERVAL, MAX_SCALE, check_range
from ...plateau import plateau_state_problems


def _number(value) -> bool:
    return type(value) in (int, float)


def _count(key: str, value, low: int, high: int) -> list[str]:
    """``key`` must be an integer (not a bool, float or tensor) in ``[low, high]``."""
    if type(value) is not int:
        return [f"{key}: {type(value).__name__} {value!r:.40} is not an integer"]
    return check_range(key, value, low, high)


def _rate(key: str, value) -> list[str]:
    """A learning rate: a number from 0 to float32's largest, as ``optimizer.lr`` must be."""
    if not _number(value):
        return [f"{key}: {type(value).__name__} is not a number"]
    return check_range(key, value, 0.0, MAX_FLOAT32)


#: What a checkpoint trained past this config's steps is refused with: no damage, a setting to raise
PAST_THE_STAGE = "is past this stage's"


def stage_limits(run) -> list[int | None]:
    """The optimizer steps each stage of this run's config may take (``None`` where it is counted in epochs of
    a stage not yet built: bounded by the epoch check instead; ``None`` for every stage when the run evaluates
    or predicts: ``mode=validate``, ``test`` or ``predict`` of a run trained longer than this config's
    ``loop.max_steps`` continues nothing, so that setting bounds nothing)."""
    if getattr(run, "mode", "fit") != "fit":
        return [None] * len(run.stages)
    limits: list[int | None] = []
    for index, (_, cfg) in enumerate(run.stages):
        if cfg.loop.max_steps is not None:
            limits.append(cfg.loop.max_steps)
        else:
            limits.append(run.total_steps(cfg) if index == run.stage_index else None)
    return limits


def position_problems(run, loop) -> list[str]:
    """The loop position (``state["loop"]``) against the stages of this run's config."""
    if not isinstance(loop, dict):
        return ["loop is not a table"]
    found = _count("loop.stage_index", loop.get("stage_index"), 0, len(run.stages) - 1)
    if found:
        return found
    index = loop["stage_index"]
    cfg = run.stages[index][1]
    accum = cfg.loop.grad_accum_steps
    limits = stage_limits(run)
    limit, earlier = limits[index], limits[:index]
    found += _count("loop.stage_step", loop.get("stage_step"), 0, limit if limit is not None else MAX_COUNT)
    if found:
        if type(loop.get("stage_step")) is int and limit is not None and loop["stage_step"] > limit >= 0:
            found = [f"loop.stage_step: {loop['stage_step']} {PAST_THE_STAGE} {limit} steps (loop.max_steps, or "
                     "max_epochs); to continue that run, set loop.max_steps (or max_epochs) to cover its steps"]
        return found
    stage_step: int = loop["stage_step"]
    before = sum(n for n in earlier if n is not None) if None not in earlier else MAX_COUNT
    found += _count("loop.global_step", loop.get("global_step"), stage_step, stage_step + before)
    if found:
        return found
    batches = (loop["stage_step"] + 1) * accum + 1  # each epoch before the current one took a batch at least
    epochs = cfg.loop.max_epochs if cfg.loop.max_steps is None else batches
    found += _count("loop.epoch", loop.get("epoch"), 0, min(epochs, batches))
    found += _count("loop.batch_in_epoch", loop.get("batch_in_epoch"), 0, batches)
    done = loop["stage_step"] * accum  # micro_step: the stage's batches, a step's worth per step taken
    found += _count("loop.micro_step", loop.get("micro_step"), done, done + accum - 1)
    found += _count("loop.last_eval_step", loop.get("last_eval_step"), -1, loop["global_step"])
    return found


def scaler_problems(precision) -> list[str]:
    """The loss scaler's state (``GradScaler``'s keys): the ranges ``precision.*`` must be in."""
    if not precision:
        return []
    if not isinstance(precision, dict):
        return ["backend.precision is not a table"]
    found = []
    if "scale" in precision:
        scale = precision["scale"]
        found += (check_range("backend.precision.scale", scale, 0.0, MAX_SCALE, open_low=True) if _number(scale)
                  else [f"backend.precision.scale: {type(scale).__name__} is not a number"])
    if "_growth_tracker" in precision:
        found += _count("backend.precision._growth_tracker", precision["_growth_tracker"], 0, MAX_GROWTH_INTERVAL)
    return found


def saved_group_count(run, state: dict) -> int:
    """How many parameter groups the checkpoint's optimizer has: its saved groups (a checkpoint of other groups
    than this run's is refused by ``Run.load_state_dict`` as a changed config, not called damaged here), else
    this run's (a sharded checkpoint keeps its optimizer's state in ``sharded/``)."""
    optimizer = state.get("optimizer")
    saved = optimizer.get("param_groups") if isinstance(optimizer, dict) and not state.get("sharded") else None
    return len(saved) if isinstance(saved, list) else len(run.optimizer.param_groups)


def schedule_problems(scheduler, groups: int) -> list[str]:
    """The built-in schedule's state (``schedule.Schedule.state_dict``): base rates one per parameter group
    (``groups`` of them), and a plan ``optimizer.*`` would accept. A ``_target_`` scheduler's state is its own."""
    if not isinstance(scheduler, dict) or "plan" not in scheduler:
        return []
    found = _count("scheduler.last_epoch", scheduler.get("last_epoch"), -1, MAX_COUNT)
    base_lrs = scheduler.get("base_lrs")
    if not isinstance(base_lrs, list) or len(base_lrs) != groups:
        found.append(f"scheduler.base_lrs: it must be a list of {groups} learning rate(s), one per parameter group")
    else:
        for i, lr in enumerate(base_lrs):
            found += _rate(f"scheduler.base_lrs[{i}]", lr)
    plan = scheduler["plan"]
    if not isinstance(plan, dict):
        return [*found, "scheduler.plan is not a table"]
    if plan.get("name") not in [s.value for s in ScheduleName]:
        found.append(f"scheduler.plan.name: {plan.get('name')!r:.40} is no schedule")
    found += _rate("scheduler.plan.lr", plan.get("lr")) + _rate("scheduler.plan.min_lr", plan.get("min_lr"))
    ratio = plan.get("min_lr_ratio")  # None: min_lr is the floor (and older checkpoints have no ratio)
    if ratio is not None:
        found += (check_range("scheduler.plan.min_lr_ratio", ratio, 0.0, 1.0) if _number(ratio)
                  else [f"scheduler.plan.min_lr_ratio: {type(ratio).__name__} is not a number"])
    found += _count("scheduler.plan.total_steps", plan.get("total_steps"), 0, MAX_COUNT)
    found += _count("scheduler.plan.warmup_steps", plan.get("warmup_steps"), 0, MAX_COUNT)
    scale = scheduler.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        found.append("scheduler.scale: it must be a finite number above 0 (run.scale_lr's multiplier)")
    if plan.get("name") == "plateau":
        found += plateau_plan_problems(plan) + plateau_state_problems(scheduler.get("plateau"))
    return found


def plateau_plan_problems(plan: dict) -> list[str]:
    """``plateau``'s settings in a schedule's plan, as its config would accept them."""
    factor = plan.get("factor")
    found = [] if isinstance(factor, float) and 0 < factor < 1 else ["scheduler.plan.factor: it must be above 0 and below 1"]
    found += _count("scheduler.plan.patience", plan.get("patience"), 0, MAX_COUNT)
    found += _count("scheduler.plan.cooldown", plan.get("cooldown"), 0, MAX_COUNT)
    threshold = plan.get("threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (math.isfinite(threshold)
                                                                                       and threshold >= 0):
        found.append("scheduler.plan.threshold: it must be a finite number from 0")
    if plan.get("threshold_mode") not in ("rel", "abs") or plan.get("mode") not in ("min", "max"):
        found.append("scheduler.plan.threshold_mode/mode: rel or abs / min or max")
    if not isinstance(plan.get("monitor"), str):
        found.append("scheduler.plan.monitor: it must be a metric's name")
    return found


def optimizer_problems(optimizer) -> list[str]:
    """The learning rates of the saved parameter groups."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return ["optimizer.param_groups is not a list of tables"]
    found = []
    for i, group in enumerate(groups):
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:  # a compiled update's rate tensor
            lr = float(lr)
        if lr is not None:
            found += _rate(f"optimizer.param_groups[{i}].lr", lr)
    return found
