"""``checkpoint.keep_best``: which checkpoint is the best by a metric, and whether an evaluation just
improved on it (then the checkpoint plugin saves at once, whatever ``every_steps`` says, as Lightning's
``ModelCheckpoint(monitor=...)`` and Hugging Face's ``load_best_model_at_end`` do).

The best is recorded in the checkpoints' index (``store.write_index``: written atomically), so a previous
best checkpoint is only removed after the index names its successor."""
from __future__ import annotations

import math
from pathlib import Path

from .store import read_best


class BestTracker:
    """The best value of ``keep_best.monitor`` so far, read from the index once and then kept."""

    def __init__(self) -> None:
        self.reported: dict[str, int] = {}  # metric name -> the step it was last reported at
        self._known: dict | None = None  # the index's best entry as last read or written
        self._read = False

    def note_reported(self, metrics, step: int) -> None:
        for name in metrics:
            self.reported[name] = step

    def previous(self, run, root: Path) -> dict | None:
        """The best checkpoint recorded so far for the stage's monitor (read from ``root``'s index once)."""
        monitor = run.stage_config.checkpoint.keep_best.monitor
        if not self._read:
            self._known, self._read = read_best(root), True
        known = self._known
        return known if known is not None and known["metric"] == monitor else None

    def value_now(self, run) -> float | None:
        """The monitor's value if it was reported at this step (by its evaluation) and is finite."""
        monitor = run.stage_config.checkpoint.keep_best.monitor
        value = run.metrics.get(monitor) if monitor else None
        if self.reported.get(monitor) != run.global_step or value is None or not math.isfinite(value):
            return None
        return float(value)

    def evaluation_improved(self, run, root: Path) -> bool:
        """Whether an evaluation at this step reported the monitor (a training metric, ``train/*``, logged
        every ``loop.log_every`` steps, does not count) better than the best checkpoint so far."""
        monitor = run.stage_config.checkpoint.keep_best.monitor
        if not monitor or monitor.startswith("train/") or run.last_eval_step != run.global_step:
            return False
        return self.value_now(run) is not None and self.improves(run, root)

    def improves(self, run, root: Path) -> bool:
        """Whether the monitor's value at this step beats the best checkpoint so far (or there is none yet)."""
        value = self.value_now(run)
        if value is None:
            return False
        previous = self.previous(run, root)
        return previous is None or _better(value, previous["value"], run)

    def best_after_saving(self, run, root: Path, name: str) -> dict | None:
        """The best checkpoint once ``name`` is saved: it, if it improves, else the previous best (``None``:
        ``keep_best`` is off, or nothing was evaluated yet)."""
        if not run.stage_config.checkpoint.keep_best.monitor:
            return None
        previous, value = self.previous(run, root), self.value_now(run)
        if value is None or (previous is not None and not _better(value, previous["value"], run)):
            return previous
        return {"name": name, "metric": run.stage_config.checkpoint.keep_best.monitor, "value": value}

    def recorded(self, best: dict | None) -> None:
        """The index now names ``best``."""
        self._known, self._read = best, True

    def forget(self) -> None:
        """Read the index again next time (a resume or a new stage may have changed it)."""
        self._read = False


def _better(value: float, than: float, run) -> bool:
    mode = getattr(run.stage_config.checkpoint.keep_best.mode, "value", run.stage_config.checkpoint.keep_best.mode)
    return value < than if mode == "min" else value > than
