"""The progress plugin: on a terminal, a tqdm bar (its width follows the terminal's) with steps done, ETA,
the latest loss and steps/s; otherwise a log line whenever training metrics are logged (``loop.log_every``)
and after each evaluation. The ``train`` event reaches ``events.jsonl`` either way (on a terminal, the bar
shows it instead of the console)."""
from __future__ import annotations

import sys

from ..hookspecs import hookimpl

#: Most important first: a narrow terminal cuts the line from the right, so the bar goes before anything else.
BAR_FORMAT = "{desc}{n_fmt}/{total_fmt} ETA {remaining}{postfix} {rate_noinv_fmt} |{bar}|"


class ProgressPlugin:
    name = "progress"

    def __init__(self, stream=None, min_interval: float = 0.1):
        self.stream = stream
        self.min_interval = min_interval
        self.tty = False
        self.total = None
        self.bar = None
        self.stepper: tuple | None = None  # (plugin manager, BarStepper) while a bar is drawn

    @hookimpl
    def on_train_start(self, run):
        self.stream = self.stream or sys.stderr
        self.tty = self.stream.isatty() and run.rank == 0
        self.total = run.global_step - run.stage_step + run.total_steps(run.stage_config)
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=run.global_step, file=self.stream, dynamic_ncols=True,
                            mininterval=self.min_interval, unit=" steps", bar_format=BAR_FORMAT,
                            desc=f"[{run.stage}] " if len(run.stages) > 1 else "")
            # the per-step hook is the bar's own plugin, registered while it is drawn: without a terminal
            # no step pays a call that does nothing
            self.stepper = (run.hooks.pm, BarStepper(self.bar))
            run.hooks.pm.register(self.stepper[1], name=f"{self.name}.bar")

    @hookimpl
    def on_log_metrics(self, run, metrics, step):
        if "train/loss" in metrics:
            loss = metrics["train/loss"]
            if self.bar is not None:
                self.bar.set_postfix_str(f"loss {loss:.4g}", refresh=False)
            run.log.info("train", progress=f"{step}/{self.total}", loss=round(loss, 4), console=not self.tty,
                         lr=float(f"{metrics['lr']:.4g}"), steps_per_sec=round(metrics["steps_per_sec"], 1))
        elif any(k.startswith("val/") for k in metrics):
            run.log.info("eval", **{k: round(v, 4) for k, v in metrics.items()})

    @hookimpl
    def on_train_end(self, run):
        self._close()

    @hookimpl
    def on_exception(self, run, error):
        self._close()

    def _close(self):
        if self.stepper is not None:
            pm, stepper = self.stepper
            pm.unregister(stepper)
            self.stepper = None
        if self.bar is not None:
            self.bar.refresh()
            self.bar.close()
            self.bar = None


class BarStepper:
    """Moves a progress bar to each step's number (``ProgressPlugin`` registers it while it draws the bar)."""

    def __init__(self, bar):
        self.bar = bar

    @hookimpl
    def on_train_step_end(self, step):
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
