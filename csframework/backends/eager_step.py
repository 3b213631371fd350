"""The step's runner of the eager backend: how one batch trains and one evaluation batch runs.

The backend chooses its runner once, when the stage's optimizer is attached: ``EagerRunner`` here, or under
``backend.compile`` one of ``backends/compile``'s (``compile/step.runner``: the whole step as one graph, or the
step's functions compiled). A runner that cannot go on (compiling failed, the step did not trace) is replaced
once, through the ``install`` callable it was given; no flag is checked per batch.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from .. import step
from ..precision import Float32, Precision


class StepRunner(Protocol):
    """What the backend calls for a batch."""

    def train_batch(self, run: Any, batch: Any, last: bool) -> dict:
        """Forward and backward of one micro-batch; on the step's ``last`` one, the update. Returns the
        micro-batch's outputs (the loop detaches them: ``Backend.train_batch``)."""

    def evaluate(self, batch: Any) -> dict:
        """Evaluation's forward and loss of one batch."""


#: How a runner is replaced: the new runner is installed where the old one was called from.
Install = Callable[[StepRunner], None]


class EagerRunner:
    """``csframework.step``'s sequence with the precision policy's primitives (``step.PrecisionOps``) and the
    module as it is: a micro-batch as it arrives, the update on the step's last one (under DDP in ``no_sync``
    on the others; under FSDP2 the gradients reduce-scattered on the last only)."""

    def __init__(self, precision: Precision | Float32 | Any, module: torch.nn.Module, *, accum: int = 1,
                 distributed: bool = False, sharded: bool = False, max_grad_norm: float | None = None):
        self.precision, self.module = precision, module
        self.accum, self.distributed, self.sharded = accum, distributed, sharded
        #: the clipping the step does itself (``None`` where the runner's update clips)
        self.max_grad_norm = max_grad_norm
        self.forward: Callable[[Any], Any] = module
        self.autocast, self.backward, self.unscale = precision.autocast, precision.backward, precision.unscale
        self.optimizer_step, self.update = precision.optimizer_step, precision.update
        # float32, one micro-batch a step, one process: the same sequence without the policy's no-op calls (not
        # for a subclass, which replaces primitives: the compiled update of PerFunctionRunner)
        if type(self) is EagerRunner and isinstance(precision, Float32) and accum == 1 and not distributed \
                and not sharded:
            self.train_batch = self._plain  # type: ignore[method-assign]

    def layout(self) -> dict:
        """The step's shape, as another runner of the same stage is built with it."""
        return dict(accum=self.accum, distributed=self.distributed, sharded=self.sharded)

    def train_batch(self, run: Any, batch: Any, last: bool) -> dict:
        if self.distributed and not last and not self.sharded:
            with run.module.no_sync():  # DDP all-reduces the gradients in the step's last micro-batch only
                outputs = step.micro_batch(run, self, self.forward, batch, self.accum)
        else:  # (the usual case asked first: one test a batch)
            if self.sharded:  # FSDP2: reduce-scatter the gradients on the step's last micro-batch only
                run.module.set_requires_gradient_sync(last)
            outputs = step.micro_batch(run, self, self.forward, batch, self.accum)
        if last:
            step.apply_gradients(run, self, self.max_grad_norm)
        return outputs  # detached by the loop, in the same walk that keeps the scalars for the log

    def _plain(self, run: Any, batch: Any, last: bool) -> dict:
        """``train_batch`` of a float32 step of one micro-batch in one process (``step.plain_step``)."""
        return step.plain_step(run, self.forward, batch, self.max_grad_norm)

    def evaluate(self, batch: Any) -> dict:
        return self.outputs(batch)

    def outputs(self, batch: Any) -> dict:
        """The model's outputs for ``batch`` under the precision policy's autocast: the forward of training and
        of evaluation alike."""
        with self.precision.autocast():
            return step.model_outputs(self.module(batch))
