"""Stop a run once an evaluation metric reaches a target (time to accuracy): ``target.value=0.95`` with
``target.metric=val/accuracy`` and ``target.mode=max``. It does nothing until ``target.value`` is set, so
installing it changes no run by surprise. The step it was reached at goes into ``summary.json``
(``target_reached_at``)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import csframework as csf

__all__ = ["StopAtTarget", "TargetConfig", "Mode"]


class Mode(str, enum.Enum):
    min = "min"
    max = "max"


@dataclass
class TargetConfig:
    """The ``target`` section of the run's config (typed and validated like the built-in sections)."""

    metric: str = "val/loss"
    """The evaluation metric to watch."""
    value: Optional[float] = None
    """Stop at the first evaluation where ``metric`` reaches this; ``null`` (the default) turns it off."""
    mode: Mode = Mode.min
    """``min``: reached at or below ``value``; ``max``: at or above."""


class StopAtTarget:
    """The plugin (entry point ``target``, config section ``target``)."""

    name = "target"

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"target": TargetConfig}

    @csf.hookimpl
    def csframework_validate(self, config):
        cfg = config.target
        if cfg.value is not None and "/" not in cfg.metric:
            return [f"target.metric: '{cfg.metric}' is no evaluation metric (those are <set>/<output>, "
                    "e.g. val/loss); set it to one"]
        return None

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        cfg = run.config.target
        if cfg.value is None or cfg.metric not in metrics:
            return
        value = metrics[cfg.metric]
        reached = value <= cfg.value if cfg.mode == Mode.min else value >= cfg.value
        if reached and "target_reached_at" not in run.summary_extra:
            run.summary_extra["target_reached_at"] = run.global_step
            run.log.info("target_reached", metric=cfg.metric, value=round(value, 5), target=cfg.value)
            run.request_stop(f"{cfg.metric} reached {cfg.value}")
