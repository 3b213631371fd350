"""TensorBoard logging for csframework: every metric the run reports as a scalar at its step, the composed
config as text, and at the end the config and final metrics as hparams. Only rank 0 writes; a resumed run
appends to the same log directory and TensorBoard drops the steps after the checkpoint it resumed from
(``purge_step``), so no step appears twice."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

import csframework as csf
from csframework.config import flat_config

__all__ = ["TensorBoardLogger", "TensorBoardConfig"]


@dataclass
class TensorBoardConfig:
    log_dir: Optional[str] = None
    """Where the event files go; ``null``: ``tensorboard/`` in the run directory."""
    flush_secs: int = 120
    """How often the writer flushes to disk, in seconds (it also flushes when the run ends)."""


def hparams_of(config) -> dict:
    """The composed config as ``{dotted.key: value}`` with values TensorBoard's hparams accept."""
    return {key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in flat_config(config).items()}


class TensorBoardLogger:
    """The plugin (entry point ``tensorboard``, config section ``tensorboard``)."""

    name = "tensorboard"

    def __init__(self):
        self.writer = None

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"tensorboard": TensorBoardConfig}

    @csf.hookimpl
    def csframework_validate(self, config):
        if config.tensorboard.flush_secs < 1:
            return [f"tensorboard.flush_secs: {config.tensorboard.flush_secs} must be >= 1"]
        return []

    @csf.hookimpl
    def on_fit_start(self, run):
        if run.rank != 0:  # under DDP every rank reports the same metrics: rank 0 writes them
            return
        from torch.utils.tensorboard import SummaryWriter

        cfg = run.config.tensorboard
        # in the run directory, a real directory of its own (csframework's safe layer: a planted link is refused)
        log_dir = Path(cfg.log_dir) if cfg.log_dir else run.files.sub("tensorboard").path
        resumed = run.global_step > 0  # the checkpoint plugin has restored the run already
        # purge_step: TensorBoard discards what an earlier process logged after the resumed checkpoint
        self.writer = SummaryWriter(str(log_dir), flush_secs=cfg.flush_secs,
                                    purge_step=run.global_step + 1 if resumed else None)
        if not resumed:
            yaml = OmegaConf.to_yaml(OmegaConf.structured(run.config))
            self.writer.add_text("config", "".join(f"    {line}\n" for line in yaml.splitlines()), 0)

    @csf.hookimpl
    def on_log_metrics(self, metrics, step):
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)

    @csf.hookimpl
    def on_fit_end(self, run):
        if self.writer is not None:
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams(hparams_of(run.config), dict(run.metrics)):
                self.writer.file_writer.add_summary(summary, run.global_step)
        self._close()

    @csf.hookimpl
    def on_exception(self):
        self._close()

    def _close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
