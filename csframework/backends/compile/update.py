"""The optimizer's settings and update function for the compiled update of ``functions.PerFunctionRunner``."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...graph.optim import unwrapped


def torch_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s update is torch's own code (a ``torch.optim`` class, or a user's subclass of one that
    keeps its ``step``): it takes ``foreach`` and ``capturable`` state."""
    return unwrapped(getattr(type(optimizer), "step", None)).__module__.startswith("torch.optim")


def fused_on_cpu(optimizer: torch.optim.Optimizer, device: torch.device, model: torch.nn.Module) -> bool:
    """Whether the per-function path runs ``optimizer``'s update eagerly, fused: on a CPU, for torch's own update
    where it has a fused kernel (Adam, AdamW, SGD, Adagrad; not for sparse gradients, which that kernel does not
    take). That kernel took 0.47 ms a step where the ``foreach`` update took 1.7 ms (the default transformer, one
    thread), and compiling the update was two thirds of the per-function path's first compile (18 of 28 s):
    docs/performance.md."""
    return (device.type == "cpu" and torch_optimizer(optimizer)
            and all("fused" in group and not group.get("differentiable") for group in optimizer.param_groups)
            and not any(getattr(m, "sparse", False) is True for m in model.modules()))


def prepare_optimizer(optimizer: torch.optim.Optimizer, device: torch.device, torch_step: bool = True,
                      fused: bool = False) -> None:
    """Make ``optimizer``'s settings those the update compiles best with (again after a checkpoint is loaded,
    which brings back the saved ones): every learning rate is a tensor (float64 on the host, float32 on a GPU)
    that the schedule fills in place, so a new rate is an input of the compiled update, not a recompilation
    (torch's optimizers take it as it is; in another optimizer's ``step``, ``p.add_(u, alpha=-group["lr"])`` and
    the other arithmetic read it as a number). Torch's own update, where it is the one run (``torch_step``), runs
    ``foreach`` with ``capturable`` state, or eagerly with its ``fused`` kernel (``fused``, ``fused_on_cpu``)."""
    own = torch_optimizer(optimizer)
    settings = {"fused": True, "foreach": False, "capturable": False} if fused else {"foreach": True, "capturable": True}
    for group in optimizer.param_groups:
        if own and torch_step:
            group.update({key: value for key, value in settings.items() if key in group})
        lr = group.get("lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):  # (a group may have none: Adafactor's None)
            dtype = torch.float64 if device.type == "cpu" else torch.float32
            group["lr"] = torch.tensor(float(lr), dtype=dtype, device=device)
    if not own:
        return
    # capturable optimizers keep their step counts on the parameters' device
    for state in optimizer.state.values():
        count = state.get("step") if isinstance(state, dict) else None
        if isinstance(count, torch.Tensor) and count.device != device:
            state["step"] = count.to(device=device, dtype=torch.float32)


def raw_step(optimizer: torch.optim.Optimizer) -> Callable:
    """``optimizer.step`` without torch's wrappers when nothing hooks it: the wrapper that switches grad mode
    breaks the graph on purpose (the update runs under ``no_grad`` here anyway), and the profiler's is ignored
    when compiling. With step hooks registered, ``step`` itself (its hooks run, the graph breaks)."""
    from torch.optim import optimizer as opt_module

    hooked = (getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None)
              or getattr(opt_module, "_global_optimizer_pre_hooks", None)
              or getattr(opt_module, "_global_optimizer_post_hooks", None))
    raw: Any = type(optimizer).step
    if hooked or "step" in vars(optimizer):  # hooks, or an instance's own step (a torch LRScheduler wraps it)
        return lambda skip: optimizer.step()
    while hasattr(raw, "__wrapped__"):
        raw = raw.__wrapped__
    return lambda skip: raw(optimizer)
