"""Plugins and nets for the bridge's tests (``plugins.enable=[bridge_plugins:<Plugin>]``,
``model.net._target_=bridge_plugins.<Net>``; the tests put this directory on ``PYTHONPATH``)."""
import os
import signal

import torch

import csframework as csf

#: What ``ClosureNet``'s step closure saw, one entry per step: the loss cstorch handed out.
CLOSED: list = []


class ClosureNet(torch.nn.Linear):
    """A net whose forward hands its output's mean to a ``@cstorch.step_closure`` (user code as cstorch's
    documentation writes it): the closure runs when cstorch ends the step."""

    def forward(self, x):
        import cerebras.pytorch as cstorch

        y = super().forward(x)
        if self.training:
            cstorch.step_closure(CLOSED.append)(y.detach().mean())
        return y


class ClosureOrder:
    """Records, at each ``on_train_batch_end``, how many of ``ClosureNet``'s step closures had run and
    whether the last one saw this step's loss; into ``summary.json`` (``closures``)."""

    name = "closure_order"

    def __init__(self):
        self.seen: list = []

    @csf.hookimpl
    def on_train_batch_end(self, run, outputs):
        self.seen.append([run.global_step, len(CLOSED)])
        run.summary_extra["closures"] = self.seen


class KillAt:
    """SIGKILL this process at ``on_train_batch_start`` of global step ``$BRIDGE_KILL_AT`` (the step after it
    is not taken): a run killed mid-training, whatever it was doing."""

    name = "kill_at"

    def __init__(self):
        self.at = int(os.environ.get("BRIDGE_KILL_AT", "0"))

    @csf.hookimpl
    def on_train_batch_start(self, run):
        if self.at and run.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
