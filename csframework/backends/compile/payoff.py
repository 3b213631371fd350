"""Whether ``backend.compile=true`` pays: the compiled step's time against the same step run eagerly.

Compiling costs seconds before the first step and saves nothing where a model's step is its matrix products (the
nanoGPT-shaped model's compiled step is about as fast as its eager one). So the run measures it, on the CPU in
one process: the compiled steps of the first ``loop.log_every`` window (those that compiled left out) are timed;
at each of the next ``EAGER_STEPS`` steps the same step is also run eagerly, once, and thrown away (where the step's
functions are compiled, the update stays compiled, as torch's capturable update must on a CPU); and if the compiled
step's median is not below the eager ones', one ``compile_not_faster`` warning gives both. So does a compiled step
that is faster, but by too little to win back the compile's seconds over the stage's steps (a small model's step
saves a fraction of a millisecond; its compile takes tens of seconds).

The eager step changes nothing the run keeps (``set_aside``): the parameters, buffers, gradients, optimizer state,
loss scale and random number generator are put back in place before the real, compiled step, and the plugins'
hooks inside the step are not called for it (``unobserved``). Until issue 51 those steps trained the model
eagerly in the middle of a compiled run, which changed its numbers (eager's rounding, not the compiled code's) for
three steps; now a compiled run trains every step compiled, with or without the check. The cost: a copy of the
model's and optimizer's tensors for each of the three steps, and the three eager steps' time in that log window's
``steps_per_sec``.
"""
from __future__ import annotations

import contextlib
import statistics
from time import perf_counter
from typing import Any, Callable, ContextManager, Iterable, Iterator, NamedTuple

import torch

#: Steps run eagerly (and thrown away) after the first log window, for the eager estimate (their median: one slow
#: first call does not decide).
EAGER_STEPS = 3


class Verdict(NamedTuple):
    """Why compiling does not pay: the median seconds of a compiled and an eager step, and (when the compiled one
    is faster) the seconds it saves over the stage's steps, fewer than the compile took."""

    compiled: float
    eager: float
    saved: float | None = None

    def event(self, compile_seconds: float, steps: int | None) -> dict:
        """The ``compile_not_faster`` warning's fields: the medians, what compiling took, and how to stop it."""
        compiled, eager = round(1e3 * self.compiled, 3), round(1e3 * self.eager, 3)
        medians = (f"the compiled step took {compiled} ms, the same step run eagerly {eager} ms (medians, after the "
                   "first loop.log_every window)")
        problem = (f"{medians}: compiling does not pay for this model on this machine" if self.saved is None else
                   f"{medians}: over the stage's {steps} steps it saves {self.saved:.2f} s, and compiling took "
                   f"{compile_seconds:.1f} s")
        return {"compiled_ms": compiled, "eager_ms": eager, "compile_seconds": round(compile_seconds, 3),
                "problem": problem, "result": "the run goes on compiled; backend.compile=false (the default) trains "
                                              "eagerly and saves the compile time"}


class Payoff:
    """The timing of one stage's steps: compiled ones in ``[0, window)``, thrown-away eager ones at the steps in
    ``[window, window + 3)`` (global steps before the step), then one verdict; ``steps``: the stage's steps
    (``None``: not known, as with ``loop.max_epochs``)."""

    def __init__(self, window: int, steps: int | None = None):
        self.window, self.steps = window, steps
        self.compiled: list[float] = []
        self.eager: list[float] = []
        self.done = False

    def eager_step(self, global_step: int) -> bool:
        """Whether the step at ``global_step`` is also run eagerly, for the estimate."""
        return not self.done and self.window <= global_step < self.window + EAGER_STEPS

    def step(self, global_step: int, train: Callable[[], dict], compiled_seconds: Callable[[], float], *,
             eager: Callable[[], Any], aside: Callable[[], ContextManager] = contextlib.nullcontext) -> dict:
        """``train()`` (the step), timed where it compiled nothing (``compiled_seconds()``, the compile time so far,
        unchanged); at an eager step, first ``eager()`` (the same step run eagerly), timed inside ``aside()`` (which
        puts back what it changed: ``set_aside``)."""
        if self.done or global_step >= self.window + EAGER_STEPS:
            self.done = True
            return train()
        if self.eager_step(global_step):
            with aside():
                start = perf_counter()
                eager()
                self.eager.append(perf_counter() - start)
            return train()
        compiling = compiled_seconds()
        start = perf_counter()
        outputs = train()
        seconds = perf_counter() - start
        if compiled_seconds() == compiling:
            self.compiled.append(seconds)
        return outputs

    def verdict(self, compile_seconds: float = 0.0) -> Verdict | None:
        """Once, after the last eager step: a ``Verdict`` when the compiled step is not faster, or saves over the
        stage's steps less than ``compile_seconds`` (what compiling took); else ``None``."""
        if self.done or len(self.eager) < EAGER_STEPS:
            return None
        self.done = True
        if not self.compiled:  # (a run resumed after the window: nothing compiled was timed)
            return None
        compiled, eager = statistics.median(self.compiled), statistics.median(self.eager)
        if compiled >= eager:
            return Verdict(compiled, eager)
        saved = (eager - compiled) * self.steps if self.steps is not None else None
        return Verdict(compiled, eager, saved) if saved is not None and saved < compile_seconds else None


@contextlib.contextmanager
def set_aside(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extras: Iterable[Any] = ()) -> Iterator[None]:
    """What a thrown-away step changes, put back when it is done, in place (the same tensors: compiled code and
    graphs that hold them stay valid): the model's parameters, buffers and gradients, the optimizer's state
    (entries the step created are removed), the tensors among ``extras`` (a loss scaler's) and torch's random
    number generator (the next step draws what it would have)."""
    grads = [(p, p.grad) for p in model.parameters()]
    states = {p: dict(s) for p, s in optimizer.state.items()}
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers(), *(g for _, g in grads if g is not None),
               *(t for t in extras if isinstance(t, torch.Tensor)),
               *(v for s in states.values() for v in s.values() if isinstance(v, torch.Tensor))]
    kept = [t.detach().clone() for t in tensors]
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, kept):
                tensor.copy_(value)
        for p, grad in grads:
            p.grad = grad
        for created in [key for key in optimizer.state if key not in states]:
            del optimizer.state[created]
        for key, state in states.items():
            optimizer.state[key].clear()
            optimizer.state[key].update(state)
        torch.set_rng_state(rng)


class _Silent:
    """Hooks that answer nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _nothing


def _nothing(**_: Any) -> None:
    return None


class unobserved:
    """``run`` as a thrown-away step sees it: the plugins' hooks are not called (it is no step of theirs)."""

    hooks = _Silent()

    def __init__(self, run: Any):
        self._run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)
