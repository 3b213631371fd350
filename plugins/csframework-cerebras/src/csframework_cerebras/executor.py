"""csframework's loop driving cstorch's ``DataExecutor`` one step at a time.

cstorch's own loop is ``for batch in executor: step(batch)``: the executor begins a step
(``on_batch_start``: the batch onto the device) as it yields the batch and ends it when asked for the next
one (``on_batch_end``: on a cluster the step executes there; then the step closures run, the checkpoint
closures on checkpoint steps). csframework's loop hands over one batch per call instead, and needs the step's
values as the call returns, so ``Steps`` asks the executor for the next batch right after the step:
the step's closures run, and the executor begins its next step. The host batch it begins that step with
is the previous one again, as cstorch itself does on a cluster (where the input workers feed the device);
on cstorch's CPU backend the step then runs on the batch the loop hands over, moved by cstorch's device.

One executor is open at a time: a train executor spans the steps up to the next evaluation or the stage's
end (a cluster runs one executor at a time, and an evaluation is an executor of its own); an evaluation
executor spans the evaluation's batches. The executor is advanced outside ``torch.inference_mode`` (which
the loop evaluates under): cstorch moves the model to its device when an executor starts, and under
inference mode that would make the parameters inference tensors, which training can no longer update.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

import torch


class _Feed:
    """The iterable cstorch's DataLoader reads (its input function returns it): the batch the loop handed
    over, then that batch again while no other came (the host batch of a step the executor begins early)."""

    def __init__(self):
        self.queue: collections.deque = collections.deque()
        self.last = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.queue:
            self.last = self.queue.popleft()
        if self.last is None:
            raise StopIteration
        return self.last


class Steps:
    """The open ``DataExecutor`` (``kind``: ``"train"`` or ``"eval"``), advanced one step per ``begin``/``end``."""

    def __init__(self, cstorch, cs):
        self.cstorch, self.cs = cstorch, cs
        self.feed = _Feed()
        self.kind: str | None = None
        self.steps = None  # the executor's iterator, while it is open
        self.ahead = None  # the device batch of the step the executor began at the end of the previous one
        self.executors = 0  # opened so far (each is a directory cerebras/executors/<n>/)

    def begin(self, kind: str, batch: Any, num_steps: Callable[[], int], loader: Callable[[Any], Any] | None = None,
              checkpoint_steps: Callable[[int], Any] | None = None) -> Any:
        """The device batch of this step of a ``kind`` executor; one is opened (``num_steps()`` steps, and
        ``checkpoint_steps(num_steps)``) if none of that kind is. ``loader(feed)``: the cstorch DataLoader
        (on a cluster, one whose input function the input workers call; else fed ``batch`` by batch)."""
        if self.kind != kind:
            self.close()
        if self.steps is None:
            steps = num_steps()
            self.feed.queue.append(batch)
            data = loader(self.feed) if loader is not None else self.cstorch.utils.data.DataLoader(self._input)
            executor = self.cstorch.utils.data.DataExecutor(
                data, num_steps=steps, checkpoint_steps=checkpoint_steps(steps) if checkpoint_steps else None)
            self.steps, self.kind = iter(executor), kind
            self.executors += 1
            with torch.inference_mode(False):
                return next(self.steps)
        ahead, self.ahead = self.ahead, None
        if self.cs.is_csx:  # the input workers feed the device: the executor's batch is the step's
            return ahead
        return self.cs.device.move_to_device(batch)

    def _input(self):
        return self.feed

    def end(self) -> None:
        """End the step: cstorch runs its step closures (and checkpoint closures on a checkpoint step), then
        begins its next step, or ends the executor after its last."""
        try:
            with torch.inference_mode(False):
                self.ahead = next(self.steps)
        except StopIteration:
            self._reset()

    def close(self) -> None:
        """End the open executor early (an evaluation, the end of a stage, a failure)."""
        steps = self.steps
        self._reset()
        if steps is not None:
            with torch.inference_mode(False):
                steps.close()

    def _reset(self) -> None:
        self.steps, self.kind, self.ahead = None, None, None
        self.feed.queue.clear()
        self.feed.last = None


def checkpoint_schedule(cstorch, first_step: int, num_steps: int, every: int | None, stage_end: bool):
    """The checkpoint steps of an executor whose step 0 is global step ``first_step``: where csframework's
    checkpoint plugin saves, the global steps that ``every`` divides and, when the executor ends the stage
    (``stage_end``), its last step; as cstorch's zero-based ``Schedule``."""
    Schedule = cstorch.utils.data.Schedule
    start = (-first_step) % every if every else num_steps
    if start < num_steps:
        return Schedule([Schedule.Range(start=start, end=num_steps, step=every, include_last=stage_end)])
    if stage_end:
        return Schedule([Schedule.Range(start=num_steps - 1, end=num_steps, step=1, include_last=True)])
    return Schedule([])
