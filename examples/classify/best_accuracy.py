"""The example's own plugin: remembers the best validation accuracy (and its step), keeps it across resume
through the checkpoint, and reports it when the run ends (console, ``events.jsonl`` and
``best_accuracy.json`` in the run directory).

Enable it with ``plugins.enable=[best_accuracy:BestAccuracy]``; turn it off again with
``plugins.disable=[best_accuracy:BestAccuracy]`` (a plugin enabled by path is named by its path).
"""
from __future__ import annotations

import json

import csframework as csf


class BestAccuracy:
    name = "best_accuracy"  # the key of this plugin's state in checkpoints

    def __init__(self, metric: str = "val/accuracy"):
        self.metric = metric
        self.best: float | None = None
        self.step: int | None = None
        self.restored = False

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        value = metrics.get(self.metric)
        if value is not None and (self.best is None or value > self.best):
            self.best, self.step = value, run.global_step

    @csf.hookimpl
    def on_checkpoint_save(self, state):
        state[self.name] = {"best": self.best, "step": self.step}

    @csf.hookimpl
    def on_checkpoint_load(self, run, state):
        saved = state.get(self.name)
        if saved:
            self.best, self.step, self.restored = saved["best"], saved["step"], True
            run.log.info("best_accuracy_restored", best=self.best, at_step=self.step)

    @csf.hookimpl
    def on_fit_end(self, run):
        if self.best is None:
            return
        run.log.info("best_accuracy", metric=self.metric, best=round(self.best, 4), at_step=self.step)
        if run.rank == 0:
            report = {"metric": self.metric, "best": self.best, "step": self.step, "restored": self.restored}
            (run.output_dir / "best_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
