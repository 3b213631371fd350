"""One optimizer step: the order of hooks and work, written once for every backend.

A step of ``loop.grad_accum_steps = k`` micro-batches::

    for each micro-batch:                       # micro_batch()
        forward under the precision policy's autocast
        on_before_backward(loss)
        backward of the loss scaled by the policy (divided by k when k > 1)
        on_after_backward()
    on the last micro-batch:                    # apply_gradients()
        unscale the gradients (the policy says whether the step must be skipped: an overflow)
        on_before_optimizer_step(optimizer)
        clip the gradient norm to optimizer.max_grad_norm
        optimizer step (skipped on overflow), loss-scale update, zero_grad

The learning-rate schedule then advances once per step, in the loop (outside any traced graph, since the
rate is an input of CSX's graph). The eager backend calls ``micro_batch`` as each batch arrives (under DDP
in ``no_sync`` on the non-final ones) and ``apply_gradients`` on the last; the CSX backend traces
``train_step`` over the step's buffered micro-batches into one static graph. A backend supplies only the
primitives, as a ``PrecisionOps``.
"""
from __future__ import annotations

import re
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import torch
from torch import Tensor

from .errors import ModelError, one_line

if TYPE_CHECKING:
    from .protocol import LoopRun


class PrecisionOps(Protocol):
    """What a backend's precision policy does inside a step (float32 has one too, a null object that does
    only the plain thing: ``precision.FLOAT32``)."""

    def autocast(self) -> AbstractContextManager:
        """The context the forward pass runs in (autocast to a half precision, or nothing)."""

    def backward(self, loss: torch.Tensor) -> None:
        """``backward`` of ``loss`` times the loss scale (if any)."""

    def unscale(self, optimizer: torch.optim.Optimizer) -> Any:
        """Divide the gradients by the loss scale; returns what ``optimizer_step`` needs to skip an
        overflowing step (``None`` when the policy tracks that itself)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, skip: Any) -> None:
        """``optimizer.step()``, skipped when ``skip`` (or the policy) says the gradients overflowed."""

    def update(self) -> None:
        """Adjust a dynamic loss scale after the step."""


def model_outputs(out: Any, model: Any = None) -> dict:
    """The model contract: a loss tensor, or a dict with ``loss``; anything else is a ``ModelError``
    naming what ``forward`` returned (the keys of a dict without ``loss``), and ``model``'s class if given."""
    if type(out) is dict and "loss" in out:  # the usual answer first: one check, not two isinstance calls
        return out
    if isinstance(out, torch.Tensor):
        return {"loss": out}
    if isinstance(out, dict) and "loss" in out:
        return out
    got = (f"a dict without a 'loss' key (its keys: {', '.join(map(repr, out))})" if isinstance(out, dict)
           else f"a {type(out).__name__}")
    where = "" if model is None else f"{type(model).__module__}.{type(model).__qualname__}."
    raise ModelError(f"model.forward: {where}forward(batch) returned {got}; return the loss tensor or a dict with a "
                     "'loss' key (and any other outputs, e.g. {'loss': loss, 'logits': logits})")


def detached(outputs: dict) -> dict:
    """``outputs`` with every tensor detached (what hooks receive; a step's outputs the loop detaches as it
    keeps them, ``RunState.keep_outputs``): a tensor that does not require grad is in no graph and is passed
    as it is (a ``detach()`` per output costs a step on a small model more than the rest of this function)."""
    return {k: v.detach() if isinstance(v, Tensor) and v.requires_grad else v for k, v in outputs.items()}


def micro_batch(run: LoopRun, ops: PrecisionOps, module: Callable[[Any], Any], batch: Any, accum: int) -> dict:
    """Forward and backward of one micro-batch of a step of ``accum`` micro-batches; returns its outputs.
    ``module``: what computes the model's outputs from a batch (the module, or its compiled forward)."""
    state = run.state  # (run.hooks is read only for a hook that is called)
    carried, quiet = state.carried, state.quiet  # quiet: hooks nobody implements, not called (RunState.quiet)
    with ops.autocast():  # a stateful model: forward(batch, state) (csframework.carried)
        try:
            outputs = module(batch) if carried is None else carried.forward(module, batch)
        except (RuntimeError, TypeError) as e:  # free until it fails: then say what to change, if it is the data's
            raise_data_problem(run, batch, e)
            raise
        if type(outputs) is not dict or "loss" not in outputs:  # (the usual answer asked here: no call)
            outputs = model_outputs(outputs, run.model)
    loss = outputs["loss"]
    if "on_before_backward" not in quiet:
        run.hooks.on_before_backward(run=run, loss=loss)
    try:
        ops.backward(loss / accum if accum > 1 else loss)
    except Exception as e:  # free until it fails: then say what model.forward returned, not torch's message
        raise_loss_problem(run, loss, e)
        raise
    if "on_after_backward" not in quiet:
        run.hooks.on_after_backward(run=run)
    return outputs


def plain_step(run: LoopRun, module: Callable[[Any], Any], batch: Any, max_grad_norm: float | None) -> dict:
    """``micro_batch`` then ``apply_gradients`` for a step of one micro-batch under the null precision policy
    (``precision.FLOAT32``: no autocast, loss scale or skipped step) in one process: the same work and hooks
    in the same order, without the policy's calls that do nothing (half of the bytecodes this sequence adds
    to a small model's step; ``EagerRunner`` chooses it once, tests/unit/test_step.py compares the two)."""
    state = run.state
    quiet, carried = state.quiet, state.carried
    try:
        outputs = module(batch) if carried is None else carried.forward(module, batch)
    except (RuntimeError, TypeError) as e:
        raise_data_problem(run, batch, e)
        raise
    if type(outputs) is not dict or "loss" not in outputs:  # (model_outputs' usual answer asked here: no call)
        outputs = model_outputs(outputs, run.model)
    loss = outputs["loss"]
    if "on_before_backward" not in quiet:
        run.hooks.on_before_backward(run=run, loss=loss)
    try:
        loss.backward()
    except Exception as e:
        raise_loss_problem(run, loss, e)
        raise
    if "on_after_backward" not in quiet:
        run.hooks.on_after_backward(run=run)
    optimizer = run.optimizer
    if "on_before_optimizer_step" not in quiet:
        run.hooks.on_before_optimizer_step(run=run, optimizer=optimizer)
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return outputs


def raise_data_problem(run: LoopRun, batch: Any, error: Exception) -> None:
    """Raise the ``ModelError`` that names the data setting or the call when ``forward``'s ``error`` is the
    data's (``integer_batch_problem``, ``double_batch_problem``) or its signature's (``call_problem``); else
    return (the caller re-raises ``error``)."""
    problem = (call_problem(run, batch, error) if isinstance(error, TypeError) else
               integer_batch_problem(run, batch, error) or double_batch_problem(run, batch, error))
    if problem is not None:
        raise ModelError(problem) from error


def call_problem(run: LoopRun, batch: Any, error: TypeError) -> str | None:
    """When calling ``forward`` itself failed (a signature of ``forward(self, x, y)``): the refusal saying how
    csframework calls it, with the batch whole; else ``None``."""
    model = type(run.model)
    if not str(error).startswith(f"{model.__name__}.forward() "):
        return None
    call = "forward(batch)" if run.state.carried is None else "forward(batch, state)"
    kind = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list, dict))
            else f"a {type(batch).__name__}")
    return (f"model.forward: {model.__module__}.{model.__qualname__}: {one_line(error)}; csframework calls {call} "
            f"with the batch whole, as data.train gives it ({kind} here): take it and unpack it inside, e.g. "
            "def forward(self, batch): x, y = batch")


def double_batch_problem(run: LoopRun, batch: Any, error: Exception) -> str | None:
    """When ``forward`` failed on a dtype mismatch and the batch holds float64 tensors (NumPy's default) where
    the model computes in float32: the refusal naming the data setting; else ``None``."""
    doubles = [t for t in _tensors(batch) if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
    if not doubles or "double" not in str(error).lower() \
            or any(p.dtype == torch.float64 for p in run.model.parameters()):
        return None
    model = type(run.model)
    data = getattr(run.stage_config.data.train, "get", lambda *_: None)("_target_") or "data.train"
    return (f"model.forward: {model.__module__}.{model.__qualname__}.forward(batch) got float64 inputs "
            f"({list(doubles[0].shape)} from data.train, {data}) and computes in float32 ({one_line(error)}); make "
            "the dataset return float32 tensors (NumPy's default is float64: torch.from_numpy(a).float(), or "
            "a.astype(np.float32))")


def raise_loss_problem(run: LoopRun, loss: Any, error: Exception) -> None:
    """Raise the ``ModelError`` that says what ``model.forward`` returned when ``backward``'s ``error`` comes
    from a loss that is no loss to train on (``loss_problem``); else return (the caller re-raises ``error``)."""
    problem = loss_problem(loss)
    if problem is not None:
        model = type(run.model)
        raise ModelError(f"model.forward: {model.__module__}.{model.__qualname__}.forward(batch) returned "
                         f"{problem}") from error


_FLOAT_AND_INTEGER = re.compile(r"(?is)(?=.*\b(long|int)\b)(?=.*\b(float|half|bfloat16|double)\b)")


def integer_batch_problem(run: LoopRun, batch: Any, error: Exception) -> str | None:
    """When ``forward`` failed on a dtype mismatch and every tensor of ``batch`` is integer (token ids: the
    default ``data=stdlib_text`` with a model of float inputs), the refusal naming the data setting; else ``None``."""
    tensors = [t for t in _tensors(batch) if isinstance(t, torch.Tensor)]
    if not tensors or any(t.is_floating_point() or t.is_complex() for t in tensors) \
            or not _FLOAT_AND_INTEGER.search(str(error)):
        return None
    model = type(run.model)
    data = getattr(run.stage_config.data.train, "get", lambda *_: None)("_target_") or "data.train"
    first = tensors[0]
    return (f"model.forward: {model.__module__}.{model.__qualname__}.forward(batch) got integer inputs "
            f"({str(first.dtype).removeprefix('torch.')} {list(first.shape)} from data.train, {data}: token ids) and "
            f"computes in floating point ({one_line(error)}); choose data of your model's inputs (data=<yours>, a "
            "conf/data/<yours>.yaml with data.train and data.val; the default data=stdlib_text is token ids for a "
            "language model) or convert them in forward (inputs.float())")


def _tensors(batch: Any) -> list:
    """The leaves of a batch (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(batch, (tuple, list)):
        return [t for item in batch for t in _tensors(item)]
    if isinstance(batch, dict):
        return [t for item in batch.values() for t in _tensors(item)]
    return [batch]


def loss_problem(loss: Any) -> str | None:
    """What makes ``loss`` no loss to train on (and the fix), or ``None``."""
    if not isinstance(loss, torch.Tensor):
        return f"a loss of type {type(loss).__name__}, not a tensor; return the tensor (before any .item())"
    what = f"shape {list(loss.shape)}, dtype {str(loss.dtype).removeprefix('torch.')}"
    if loss.numel() != 1:
        return (f"a loss of {what}, not a scalar; a loss per sample: reduce it to one number (e.g. loss.mean()); "
                "the model's predictions: return the loss computed from them and the targets (e.g. "
                "F.mse_loss(preds, targets)), or a dict with it under 'loss'")
    if not loss.is_floating_point():
        return f"a loss of {what}, not a floating-point number; compute it in floating point"
    if not loss.requires_grad:
        return (f"a loss of {what} that does not require grad: it is not computed from the model's parameters "
                "(detached, or under torch.no_grad()); return it as computed")
    return None


def apply_gradients(run: LoopRun, ops: PrecisionOps, max_grad_norm: float | None) -> None:
    """The end of a step: unscale, ``on_before_optimizer_step``, clip, optimizer step, scale update,
    ``zero_grad``."""
    optimizer = run.optimizer
    skip = ops.unscale(optimizer)
    if "on_before_optimizer_step" not in run.state.quiet:
        run.hooks.on_before_optimizer_step(run=run, optimizer=optimizer)
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_grad_norm)
    ops.optimizer_step(optimizer, skip)
    ops.update()
    optimizer.zero_grad(set_to_none=True)


def train_step(run: LoopRun, ops: PrecisionOps, module: Callable[[Any], Any], batches: Iterable[Any],
               max_grad_norm: float | None) -> dict:
    """A whole step over its micro-batches at once; returns the outputs of the last one (detached)."""
    batches = list(batches)
    outputs: dict = {}
    for batch in batches:
        outputs = micro_batch(run, ops, module, batch, len(batches))
    apply_gradients(run, ops, max_grad_norm)
    return detached(outputs)
