"""Carried state: the model contract's stateful form, for a model that carries a state from batch to batch
(a recurrent language model's hidden state over a batchified token stream, trained with truncated
backpropagation through time).

A model is stateful when it has an ``initial_state(batch)`` method. Its ``forward(batch, state)`` then
takes the state the previous batch left and returns ``(loss or outputs dict, new state)``. The loop:

- starts a pass with ``initial_state(batch)`` (given the pass's first batch, already on the device, so it
  can size the state: only the model knows which dimension of a batch is the batch): at the start of every
  training epoch and of every evaluation set's pass;
- detaches the returned state before the next batch (no gradient flows into an earlier batch: each
  micro-batch's backward is its own, so with ``loop.grad_accum_steps`` too);
- keeps training's state apart from evaluation's (an evaluation in the middle of an epoch does not disturb
  it) and saves it in checkpoints, so a run resumed in the middle of an epoch goes on exactly;
- refuses what cannot be right with it (``refusals``): shuffled training data, a sampled evaluation, a
  backend that cannot pass a state (compiled steps, CSX) or that has a state per rank (DDP, FSDP).

A state is a tensor or a tuple, list or dict of them (e.g. an LSTM's ``(h, c)``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from .errors import ConfigError, ModelError, ValidationError


def is_stateful(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries a state between batches: it has an ``initial_state`` method."""
    return callable(getattr(model, "initial_state", None))


class CarriedState:
    """The state of a stateful model between batches (``run.state.carried``; ``None`` for other models)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.value: Any = None
        """The state the next batch gets; ``None``: the next batch starts a pass (``initial_state``)."""

    def forward(self, module: Callable[..., Any], batch: Any, checked: bool = True) -> Any:
        """``module(batch, state)``'s outputs (a loss or a dict, as a stateless ``forward`` returns), keeping
        the new state, detached, for the next batch; ``checked``: as the model contract says (a loss in them,
        ``step.model_outputs``), else as returned (``mode=predict``: batches without targets give no loss)."""
        from .step import model_outputs

        state = self.model.initial_state(batch) if self.value is None else self.value  # type: ignore[operator]
        returned = module(batch, state)
        if not isinstance(returned, (tuple, list)) or len(returned) != 2:
            length = f" of {len(returned)}" if isinstance(returned, (tuple, list)) else ""
            got = f"a {type(returned).__name__}{length}"
            raise ModelError(f"model.forward: {self._name()} has initial_state, so forward(batch, state) must return "
                             f"(loss or outputs dict, new state); it returned {got}")
        self.value = detached_state(returned[1], f"model.forward: {self._name()}.forward(batch, state)")
        return model_outputs(returned[0], self.model) if checked else returned[0]

    def reset(self) -> None:
        """The next batch starts a pass: it gets ``initial_state``."""
        self.value = None

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """An evaluation set's pass: it starts from ``initial_state``, and training's state is back after it."""
        training, self.value = self.value, None
        try:
            yield
        finally:
            self.value = training

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, saved: Any, device: torch.device) -> None:
        """Restore a checkpoint's state (read from a file: anything but a nest of tensors is refused)."""
        value = saved.get("value") if isinstance(saved, dict) else None
        if value is not None:
            other = non_tensor(value)
            if other is not None:
                raise ConfigError(f"checkpoint: its carried state holds a {other}, not only tensors; it was not "
                                  "written by this run's model")
            from .data import move_to

            value = move_to(value, device)
        self.value = value

    def _name(self) -> str:
        model = type(self.model)
        return f"{model.__module__}.{model.__qualname__}"


def non_tensor(state: Any) -> str | None:
    """The type name of the first thing in ``state`` that is no tensor (tuples, lists and dicts walked), or
    ``None``: a state must be saved in a checkpoint and moved to a device."""
    if isinstance(state, torch.Tensor):
        return None
    parts = state.values() if isinstance(state, dict) else state if isinstance(state, (tuple, list)) else None
    if parts is None:
        return type(state).__name__
    return next((found for found in map(non_tensor, parts) if found is not None), None)


def detached_state(state: Any, owner: str) -> Any:
    """``state`` with every tensor detached; a ``ModelError`` naming ``owner`` when it holds anything but
    tensors in tuples, lists and dicts."""
    other = non_tensor(state)
    if other is not None:
        raise ModelError(f"{owner}: a carried state holds a {other}; make it a tensor, or a tuple, list or dict of "
                         "tensors")
    return _detach(state)


def _detach(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, dict):
        return {k: _detach(v) for k, v in state.items()}
    return type(state)(_detach(s) for s in state)


def for_model(model: torch.nn.Module, stages: list[tuple[str, Any]]) -> CarriedState | None:
    """The carried state of ``model`` (``None`` for a stateless one), or a ``ValidationError`` with a line for
    each thing its stages cannot do with one (``refusals``): the run is refused when it is built."""
    problems = refusals(model, stages)
    if problems:
        raise ValidationError(problems)
    return CarriedState(model) if is_stateful(model) else None


def refusals(model: torch.nn.Module, stages: list[tuple[str, Any]]) -> list[str]:
    """What a stateful ``model`` cannot do in these stages (``[]`` for a stateless one): one line each."""
    if not is_stateful(model):
        return []
    name = f"{type(model).__module__}.{type(model).__qualname__}"
    problems: list[str] = []
    for _, cfg in stages:  # a setting of the run is every stage's: said once
        problems += [p for p in _stage_refusals(name, cfg) if p not in problems]
    return problems


def _stage_refusals(name: str, cfg: Any) -> list[str]:
    carries = f"{name} carries its state from batch to batch (initial_state)"
    problems = []
    if cfg.data.shuffle:
        problems.append(f"data.shuffle: {carries}, so its batches must come in order; set data.shuffle=false")
    sample = getattr(cfg.data.eval_sample, "value", cfg.data.eval_sample)
    if cfg.loop.eval_steps is not None and sample != "sequential":
        problems.append(f"data.eval_sample: {carries}, and loop.eval_steps={cfg.loop.eval_steps} with "
                        f"data.eval_sample={sample} draws batches from all over the set, mixing its sequences; set "
                        "data.eval_sample=sequential (the first batches, in order) or loop.eval_steps=null")
    backend = cfg.backend
    if cfg.device.type not in ("CPU", "GPU") or getattr(backend, "name", None) is not None:
        problems.append(f"device: {carries}, which only the eager CPU/GPU backend passes; use device=cpu or gpu")
    elif getattr(backend, "compile", False):
        problems.append(f"backend.compile: {carries}, which the compiled step does not pass; set "
                        "backend.compile=false")
    strategy = getattr(getattr(backend, "strategy", None), "value", "single")
    if strategy != "single":
        problems.append(f"backend.strategy: {carries}, and under {strategy} each rank would carry its own, which "
                        "a checkpoint does not keep; set backend.strategy=single")
    return problems

