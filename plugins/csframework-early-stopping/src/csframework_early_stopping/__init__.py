"""Early stopping for csframework: after ``patience`` evaluations in a row without an improvement of at
least ``min_delta`` in ``monitor``, the run stops through ``run.request_stop`` (final evaluation and
checkpoint as at a normal end). It does nothing until ``early_stopping.patience`` is set, so installing
it never changes a run by surprise. Its counters are saved in checkpoints, so a resumed run stops at the
same step as an uninterrupted one."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import csframework as csf

__all__ = ["EarlyStopping", "EarlyStoppingConfig", "Mode"]


class Mode(str, enum.Enum):
    min = "min"
    max = "max"


@dataclass
class EarlyStoppingConfig:
    monitor: str = "val/loss"
    """The evaluation metric to watch (evaluation reports ``val/<output>`` for each scalar the model returns)."""
    mode: Mode = Mode.min
    """``min``: lower is better; ``max``: higher is better."""
    patience: Optional[int] = None
    """Evaluations in a row without improvement before stopping; ``null`` (the default) turns it off."""
    min_delta: float = 0.0
    """The smallest change that counts as an improvement."""


class EarlyStopping:
    """The plugin (entry point ``early_stopping``, config section ``early_stopping``)."""

    name = "early_stopping"

    def __init__(self):
        self.best: float | None = None
        self.wait = 0

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"early_stopping": EarlyStoppingConfig}

    @csf.hookimpl
    def csframework_validate(self, config):
        cfg = config.early_stopping
        if cfg.patience is None:
            return []
        problems = []
        if cfg.patience < 1:
            problems.append(f"early_stopping.patience: {cfg.patience} must be >= 1 (or null to turn it off)")
        if cfg.min_delta < 0:
            problems.append(f"early_stopping.min_delta: {cfg.min_delta} must be >= 0")
        if not cfg.monitor.startswith("val/"):
            problems.append(f"early_stopping.monitor: '{cfg.monitor}' is not an evaluation metric; evaluation "
                            "reports val/<name> (e.g. val/loss)")
        elif config.data.val is None:
            problems.append(f"early_stopping.monitor: {cfg.monitor} comes from evaluation, but data.val is null; "
                            "set data.val or turn early stopping off (early_stopping.patience=null)")
        return problems

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        cfg = run.stage_config.early_stopping  # a stage may set its own
        if cfg.patience is None or run.status != "running":
            return
        if cfg.monitor not in metrics:
            raise csf.ConfigError(f"early_stopping.monitor: evaluation reported no '{cfg.monitor}' "
                                  f"(it reported {', '.join(sorted(metrics)) or 'nothing'})")
        value = metrics[cfg.monitor]
        lower = cfg.mode == Mode.min
        if self.best is None or (value < self.best - cfg.min_delta if lower else value > self.best + cfg.min_delta):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= cfg.patience:
            run.request_stop(f"early_stopping: {cfg.monitor} did not improve on {self.best:.6g} by more than "
                             f"{cfg.min_delta:g} in {self.wait} evaluations")

    @csf.hookimpl
    def on_checkpoint_save(self, state):
        state[self.name] = {"best": self.best, "wait": self.wait}

    @csf.hookimpl
    def on_checkpoint_load(self, state):
        saved = state.get(self.name) or {}
        self.best, self.wait = saved.get("best"), saved.get("wait", 0)
