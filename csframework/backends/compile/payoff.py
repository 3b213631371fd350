"""Whether ``backend.compile=true`` pays: the compiled step's time against the same step run eagerly.

Compiling costs seconds before the first step and saves nothing where a model's step is its matrix products (the
nanoGPT-shaped model's compiled step is about as fast as its eager one). So the run measures it, on the CPU in
one process: the compiled steps of the first ``loop.log_every`` window (those that compiled left out) are timed,
then the next ``EAGER_STEPS`` steps train eagerly (the same step without its compiled code: the eager estimate;
where the step's functions are compiled, the update stays compiled, as torch's capturable update must on a CPU),
and if the compiled step's median is not below the eager ones', one ``compile_not_faster`` warning gives both.
The eager steps are at fixed global steps, so a resumed run trains exactly as the uninterrupted one.
"""
from __future__ import annotations

import statistics
from time import perf_counter
from typing import Callable

#: Steps trained eagerly after the first log window, for the eager estimate (their median: one slow first call
#: does not decide).
EAGER_STEPS = 3


class Payoff:
    """The timing of one stage's steps: compiled ones in ``[0, window)``, eager ones in ``[window, window + 3)``
    (global steps before the step), then one verdict."""

    def __init__(self, window: int):
        self.window = window
        self.compiled: list[float] = []
        self.eager: list[float] = []
        self.done = False

    def eager_step(self, global_step: int) -> bool:
        """Whether the step at ``global_step`` trains eagerly, for the estimate."""
        return not self.done and self.window <= global_step < self.window + EAGER_STEPS

    def step(self, global_step: int, train: Callable[[], dict], compiled_seconds: Callable[[], float]) -> dict:
        """``train()`` (the step), timed: a compiled step that compiled nothing (``compiled_seconds()``, the compile
        time so far, unchanged), or an eager one."""
        if self.done or global_step >= self.window + EAGER_STEPS:
            self.done = True
            return train()
        compiling = compiled_seconds()
        start = perf_counter()
        outputs = train()
        seconds = perf_counter() - start
        if self.eager_step(global_step):
            self.eager.append(seconds)
        elif compiled_seconds() == compiling:
            self.compiled.append(seconds)
        return outputs

    def verdict(self) -> tuple[float, float] | None:
        """Once, after the last eager step: ``(compiled, eager)`` median seconds a step when the compiled step is
        not faster, else ``None``."""
        if self.done or len(self.eager) < EAGER_STEPS:
            return None
        self.done = True
        if not self.compiled:  # (a run resumed after the window: nothing compiled was timed)
            return None
        compiled, eager = statistics.median(self.compiled), statistics.median(self.eager)
        return (compiled, eager) if compiled >= eager else None
