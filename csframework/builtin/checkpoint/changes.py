"""What a resumed run finds changed since its checkpoint: the settings the checkpoint keeps (the optimizer's
and the schedule's, ``RESUMED_SETTINGS``), said in one warning, and the config sections that explain a
model that does not fit."""
from __future__ import annotations

import math

from typing import cast

from omegaconf import OmegaConf

from ...schedule import Schedule, lr_factor


def _flatten(node, prefix: str) -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: node}


def config_differences(saved_yaml: str, config, section: str) -> list[str]:
    try:
        saved = cast(dict, OmegaConf.to_container(OmegaConf.create(saved_yaml or "{}"))).get(section)
    except Exception:  # noqa: BLE001 - a config we cannot read names nothing
        return []
    now = cast(dict, OmegaConf.to_container(OmegaConf.structured(config))).get(section)
    before, after = _flatten(saved, section), _flatten(now, section)
    return [f"{key} is {before.get(key, '(unset)')} in the checkpoint, {after.get(key, '(unset)')} now"
            for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]


#: What a resumed stage takes from its checkpoint, not from the config: the optimizer's settings (torch's
#: ``load_state_dict`` restores them with its state) and the learning-rate schedule (``Schedule``'s plan, a
#: torch scheduler's own state), planned for the stage's length then (``loop.max_steps``/``max_epochs``).
RESUMED_SETTINGS = ("loop.max_steps", "loop.max_epochs", "optimizer.lr", "optimizer.weight_decay",
                    "optimizer.momentum", "optimizer.nesterov", "optimizer.betas", "optimizer.eps",
                    "optimizer.schedule.")
LENGTH = ("loop.max_steps", "loop.max_epochs")


def changed_settings(saved_yaml: str, config, stage: str) -> list[tuple[str, object, object]]:
    """``(key, in the checkpoint, now)`` for each of ``RESUMED_SETTINGS`` whose value for stage ``stage`` in
    the checkpoint's config (``saved_yaml``) is not its value in ``config`` (the stage's config now). A
    key the checkpoint's config lacks (an older csframework's) is left out, as is a config it cannot read."""
    try:
        saved = cast(dict, OmegaConf.to_container(OmegaConf.create(saved_yaml or "{}")))
        partial = (saved.get("stages") or {}).get(stage) or {}
        before = {}
        for section in ("loop", "optimizer"):
            merged = OmegaConf.merge(saved.get(section) or {}, partial.get(section) or {})
            before.update(_flatten(OmegaConf.to_container(merged), section))
    except Exception:  # noqa: BLE001 - a config we cannot read names nothing
        return []
    now = cast(dict, OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True))
    after = {**_flatten(now["loop"], "loop"), **_flatten(now["optimizer"], "optimizer")}
    return [(key, before[key], after[key]) for key in sorted(set(before) & set(after))
            if key.startswith(RESUMED_SETTINGS) and key != "optimizer.schedule.interval"
            and before[key] != after[key]]


def changes_problem(run, changes: list[tuple[str, object, object]]) -> str:
    """What the settings changed since a resumed stage's checkpoint mean, in one line: the schedule and the
    optimizer's settings go on as saved; a longer stage trains on at the rates its plan gives past its end
    (its final rate, after the rest of a warm-up longer than the plan)."""
    text = (f"resuming at step {run.global_step} continues the checkpoint's learning-rate schedule and "
            "optimizer settings")
    sched = run.scheduler
    if any(key in LENGTH for key, _, _ in changes) and isinstance(sched, Schedule):
        offset, planned = run.global_step - run.stage_step, sched.total_steps
        end = offset + run.total_steps(run.stage_config)
        if end > offset + planned:  # the rates the plan gives past its end (a warm-up longer than it goes on)
            first, last = (sched.base_lrs[0] * lr_factor(step, sched.cfg, planned)
                           for step in (planned, end - offset - 1))
            rates = (f"stays at its final {last:.3g}" if math.isclose(first, last) else
                     f"goes from {first:.3g} to {last:.3g}")
            text += (f"; the schedule was planned for {planned} steps, so from step {offset + planned} to {end} "
                     f"the rate {rates}")
        else:
            text += f"; the schedule was planned for {planned} steps, so training stops at step {end}, before its end"
    others = [key for key, _, _ in changes if key not in LENGTH]
    if others:
        text += (f"; {', '.join(others)} keep{'s' if len(others) == 1 else ''} the checkpoint's "
                 f"value{'' if len(others) == 1 else 's'}")
    return text + "; start a new run for a schedule over the new settings"
