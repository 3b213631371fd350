"""Traceable updates for the built-in optimizers (``torch.optim.SGD``, ``Adam``, ``AdamW``).

torch's own ``step()`` reads the step counter with ``.item()`` and takes the learning rate as a Python
number (``alpha=-lr``), so it cannot be captured into a graph whose learning rate is an input. These
functions perform the same update, operation for operation, from the optimizer's own ``param_groups`` and
``state`` (torch's state format, so checkpoints stay interchangeable with eager runs) with the learning rate
and the step counter as tensors:

* the bias corrections and the step size are computed in float64, as torch computes them in Python floats,
  and rounded to the parameter's dtype where torch's kernels round the Python scalar (they are computed as
  one vector per param group, whose vectorised ``pow`` can differ from Python's in the last float64 bit; in
  practice that disappears in the rounding to float32: Adam/AdamW runs are bit-identical to eager ones);
* the only difference left is that ``param.add_(g, alpha=-lr)`` (SGD) fuses the multiply-add on CPU while
  the graph multiplies and adds separately: at most one rounding step apart per update.

``skip`` (a bool tensor) makes every update conditional without a host synchronisation: the new values are
selected with ``torch.where`` (dynamic loss scaling skips a step whose gradients overflowed).

State is created before the trace (``preinitialize``), never inside it: a Cerebras system keeps optimizer
state resident like weights, so it must exist, with its final shape, before the step is compiled. SGD's
momentum buffer starts at zero, which gives torch's first step exactly when ``dampening`` is 0 (torch copies
the first gradient instead; with ``dampening != 0`` the first step is damped here, as on Cerebras).
"""
from __future__ import annotations

import torch

BUILTIN = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def unwrapped(fn):
    """``fn`` without the decorators that wrap it (``functools.wraps``: torch wraps ``Optimizer.step`` in its
    profiling and grad-mode wrappers)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def builtin_base(cls: type) -> type | None:
    """The built-in optimizer whose update optimizers of class ``cls`` run: the class itself, or the built-in
    a user's subclass derives from when it keeps its ``step`` (``class MyAdamW(torch.optim.AdamW)`` that sets
    its parameter groups); ``None`` for any other update."""
    base = next((b for b in cls.__mro__ if b in BUILTIN), None)
    if base is None or unwrapped(getattr(cls, "step", None)) is not unwrapped(base.step):
        return None
    return base


def is_builtin(optimizer) -> bool:
    """Whether ``optimizer``'s update is a built-in one (``step`` below performs it)."""
    return builtin_base(type(optimizer)) is not None


def preinitialisable(cls: type) -> bool:
    """Whether optimizers of class ``cls`` can have their state created before the trace: the built-ins
    (SGD, Adam, AdamW) and their subclasses that keep the built-in update, or a class with a
    ``preinitialize()`` method."""
    return builtin_base(cls) is not None or callable(getattr(cls, "preinitialize", None))


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def preinitialize(optimizer) -> None:
    """Create every state tensor the optimizer's update needs (torch's layout), if missing.

    Custom optimizers may define ``preinitialize()``; it is called instead.
    """
    if not is_builtin(optimizer):
        hook = getattr(optimizer, "preinitialize", None)
        if callable(hook):
            hook()
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = optimizer.state[p]
                if isinstance(optimizer, torch.optim.SGD):
                    if group["momentum"] != 0 and state.get("momentum_buffer") is None:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    continue
                if "step" not in state:
                    on_device = group.get("capturable") or group.get("fused")
                    state["step"] = torch.zeros((), dtype=_scalar_dtype(),
                                                device=p.device if on_device else "cpu")
                for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                    if key not in state:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _lr64(lr) -> torch.Tensor:
    if isinstance(lr, torch.Tensor):
        return lr.to(torch.float64)
    return torch.tensor(float(lr), dtype=torch.float64)


def _once(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, computed into a buffer of its own when the graph is compiled. Inductor otherwise inlines a
    per-step scalar (a bias correction: a ``pow`` in float64) into the loop over every element of every
    parameter, where the C++ compiler cannot hoist it (the loop's stores may alias its inputs): that made the
    update of 200K parameters 4x slower. A reduction is always computed once; the max of two copies of ``x`` is
    ``x`` exactly."""
    return torch.stack([x, x]).amax(0)


def _update(name: str, inplace: bool, xs: list, *args, **kwargs) -> list:
    """``torch._foreach_<name>_`` on ``xs`` (returns ``xs``) when updating in place, else the out-of-place op."""
    if inplace:
        getattr(torch, f"_foreach_{name}_")(xs, *args, **kwargs)
        return xs
    return getattr(torch, f"_foreach_{name}")(xs, *args, **kwargs)


def _commit(targets: list, news: list, skip) -> None:
    """Under ``skip`` the updates were computed out of place: keep the old values where ``skip`` is set."""
    if skip is not None and targets:
        torch._foreach_copy_(targets, [torch.where(skip, t, n) for t, n in zip(targets, news)])


def step(optimizer, skip: torch.Tensor | None = None) -> None:
    """One update of a built-in optimizer from the current ``.grad``s; traceable (no host reads).

    List (``torch._foreach_*``) operations keep the graph small; on CPU they apply torch's per-tensor
    operation to each tensor, so the arithmetic is the single-tensor optimizer's. Without ``skip`` the state
    is updated in place, as torch does; with it the new values are computed aside and selected.
    """
    if not is_builtin(optimizer):
        _custom_step(optimizer, skip)
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group.get("maximize", False):
                grads = list(torch._foreach_neg(grads))
            if isinstance(optimizer, torch.optim.SGD):
                _sgd_group(optimizer, group, params, grads, skip)
            else:
                _adam_group(optimizer, group, params, grads, skip, decoupled=bool(group.get(
                    "decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))))


def _custom_step(optimizer, skip) -> None:
    """A preinitialised custom optimizer's own ``step()``; with ``skip``, its parameters and state tensors
    keep their old values where ``skip`` is true (selected with ``torch.where``, no host read)."""
    if skip is None:
        optimizer.step()
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        old_params = [p.detach().clone() for p in params]
        old_state = [(optimizer.state[p], key, value.clone()) for p in params if p in optimizer.state
                     for key, value in optimizer.state[p].items() if isinstance(value, torch.Tensor)]
    optimizer.step()
    with torch.no_grad():
        for p, old in zip(params, old_params):
            p.copy_(torch.where(skip, old, p))
        for state, key, old in old_state:
            state[key] = torch.where(skip, old, state[key])


def _sgd_group(optimizer, group, params, grads, skip) -> None:
    inplace = skip is None
    lr = _lr64(group["lr"])
    weight_decay, momentum = group["weight_decay"], group["momentum"]
    dampening, nesterov = group["dampening"], group["nesterov"]
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if momentum != 0:
        bufs = [optimizer.state[p]["momentum_buffer"] for p in params]
        new_bufs = _update("mul", inplace, bufs, momentum)
        torch._foreach_add_(new_bufs, grads, alpha=1 - dampening)
        _commit(bufs, new_bufs, skip)
        grads = torch._foreach_add(grads, new_bufs, alpha=momentum) if nesterov else new_bufs
    neg_lr: dict = {}
    for p in params:
        if p.dtype not in neg_lr:
            neg_lr[p.dtype] = (-lr).to(p.dtype)
    updates = torch._foreach_mul(grads, [neg_lr[p.dtype] for p in params])
    _commit(params, _update("add", inplace, params, updates), skip)


def _adam_group(optimizer, group, params, grads, skip, decoupled: bool) -> None:
    inplace = skip is None
    lr = _lr64(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    eps, weight_decay, amsgrad = group["eps"], group["weight_decay"], group["amsgrad"]
    states = [optimizer.state[p] for p in params]
    steps = [st["step"] for st in states]
    exp_avgs = [st["exp_avg"] for st in states]
    exp_avg_sqs = [st["exp_avg_sq"] for st in states]
    new_steps = _update("add", inplace, steps, 1)
    new_params = params
    if weight_decay != 0:
        if decoupled:
            new_params = _update("mul", inplace, params, _once(1 - lr * weight_decay))
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    new_avgs = _update("lerp", inplace, exp_avgs, grads, 1 - beta1)
    new_sqs = _update("mul", inplace, exp_avg_sqs, beta2)
    torch._foreach_addcmul_(new_sqs, grads, grads, value=1 - beta2)
    # bias corrections in float64, as torch computes them in Python floats: 1 - beta ** step (one vector for
    # the group: a handful of graph operations instead of a handful per parameter)
    steps64 = torch.stack([s.to(lr.device) for s in new_steps]).to(torch.float64)
    neg_step_size = _once(-(lr / (1 - torch.pow(beta1, steps64)))).unbind()
    bias_correction2_sqrt = _once((1 - torch.pow(beta2, steps64)).sqrt()).unbind()
    if amsgrad:
        maxes = [st["max_exp_avg_sq"] for st in states]
        new_maxes = _update("maximum", inplace, maxes, new_sqs)
        _commit(maxes, new_maxes, skip)
        denom = torch._foreach_div(torch._foreach_sqrt(new_maxes), bias_correction2_sqrt)
    else:
        denom = torch._foreach_div(torch._foreach_sqrt(new_sqs), bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    new_params = _update("addcdiv", inplace and new_params is params, new_params,
                         torch._foreach_mul(new_avgs, neg_step_size), denom)
    _commit(steps, new_steps, skip)
    _commit(exp_avgs, new_avgs, skip)
    _commit(exp_avg_sqs, new_sqs, skip)
    _commit(params, new_params, skip)
