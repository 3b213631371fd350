"""``optimizer.schedule.name=plateau``: the rule of torch's ``ReduceLROnPlateau`` (factor, patience,
threshold, cooldown, a floor), stepped at each evaluation of a fit with the value of the monitored metric.
It only keeps a multiplier of ``optimizer.lr``; ``schedule.Schedule`` multiplies it into every rate, so
warm-up, parameter groups' ``lr_scale`` and ``run.scale_lr`` combine with it. Its state (the multiplier,
the best value, the bad evaluations and the cooldown) goes into checkpoints with the schedule's, so a
resumed run reduces the rate exactly where the uninterrupted one does."""
from __future__ import annotations

import math

from .config import ScheduleConfig
from .errors import ConfigError

#: A reduction smaller than this (in the rate) is not made, as torch's ``eps``.
EPS = 1e-8


class Plateau:
    """The multiplier (``scale``) of ``optimizer.lr`` after the evaluations seen so far."""

    def __init__(self, settings: ScheduleConfig, lr: float):
        self.settings, self.lr = settings, lr
        self.scale = 1.0
        minimise = getattr(settings.mode, "value", settings.mode) == "min"
        self.best = math.inf if minimise else -math.inf  # the best value seen (NaN is never better)
        self.bad = 0  # evaluations since the best that did not improve on it
        self.cooldown_left = 0

    def observe(self, value: float) -> bool:
        """One evaluation's value of the monitored metric; ``True`` when it reduced the rate."""
        s = self.settings
        if self._better(value, self.best):
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.bad = 0
        if self.bad <= s.patience:
            return False
        self.bad, self.cooldown_left = 0, s.cooldown
        # the floor: an absolute min_lr, else min_lr_ratio of the rate (as linear and cosine decay to)
        floor = (s.min_lr / self.lr if s.min_lr is not None else s.min_lr_ratio) if self.lr > 0 else 0.0
        reduced = max(self.scale * s.factor, floor)
        if (self.scale - reduced) * self.lr <= EPS:
            return False
        self.scale = reduced
        return True

    def _better(self, value: float, best: float) -> bool:
        s = self.settings
        rel = getattr(s.threshold_mode, "value", s.threshold_mode) == "rel"
        if getattr(s.mode, "value", s.mode) == "min":
            return value < (best * (1 - s.threshold) if rel else best - s.threshold)
        return value > (best * (1 + s.threshold) if rel else best + s.threshold)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "best": self.best, "bad": self.bad, "cooldown_left": self.cooldown_left}

    def load_state_dict(self, state: dict) -> None:
        """Go on from a checkpoint's state (checked by ``checkpoint.readback`` before it gets here)."""
        self.scale, self.bad = float(state["scale"]), int(state["bad"])
        self.best = float(state["best"])
        self.cooldown_left = int(state["cooldown_left"])


def monitored_value(settings: ScheduleConfig, metrics: dict) -> float:
    """The value of ``schedule.monitor`` an evaluation reported; ``ConfigError`` naming the metrics there
    are when it reported none (a typo would otherwise never reduce the rate)."""
    value = metrics.get(settings.monitor)
    if value is None:
        when = (" (training's metrics are those of the last log, at loop.log_every: none was logged before this "
                "evaluation; log at least as often as you evaluate, or monitor a validation metric)"
                if settings.monitor.startswith("train/") else "")
        raise ConfigError(f"optimizer.schedule.monitor: the evaluation reported no {settings.monitor!r}{when} "
                          f"(it reported {', '.join(sorted(metrics)) or 'nothing'}); set it to one of them")
    return float(value)


def plateau_state_problems(state) -> list[str]:
    """Why a checkpoint's plateau state (``Plateau.state_dict``) is not one this module writes."""
    if not isinstance(state, dict):
        return ["scheduler.plateau is not a table"]
    found = []
    scale = state.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale <= 1:
        found.append("scheduler.plateau.scale: it must be a number from 0 to 1")
    best = state.get("best")
    if isinstance(best, bool) or not isinstance(best, (int, float)) or math.isnan(best):
        found.append("scheduler.plateau.best: it must be a number (infinite before the first evaluation)")
    for key in ("bad", "cooldown_left"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
            found.append(f"scheduler.plateau.{key}: it must be a count (an integer from 0)")
    return found
