"""What differs between the torch versions csframework supports (``torch>=2.4``, the version the Cerebras
stack pins, up to the newest): one place for the version checks, so every refusal of a feature a torch
lacks is the same one line naming the feature and the version it needs."""
from __future__ import annotations

import functools
import inspect

import torch

#: The running torch's ``(major, minor)``.
TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def needs_torch(feature: str, version: tuple[int, int]) -> str | None:
    """Why ``feature`` cannot run here (one line: the feature, the torch it needs and this one), or ``None``
    when this torch is new enough."""
    if TORCH >= version:
        return None
    return (f"{feature} needs torch>={version[0]}.{version[1]}, and this is torch {torch.__version__}; "
            "upgrade torch, or do without it")


def get_proxy_mode():
    """The active ``make_fx`` proxy mode, or ``None`` (``get_proxy_mode`` from torch 2.5 on;
    ``get_innermost_proxy_mode`` before)."""
    from torch.fx.experimental import proxy_tensor

    getter = getattr(proxy_tensor, "get_proxy_mode", None) or proxy_tensor.get_innermost_proxy_mode
    return getter()


@functools.lru_cache(maxsize=None)
def make_fx_options() -> dict:
    """``make_fx``'s optional keyword arguments the emulator's tracer passes, those this torch has
    (``_disable_torch_fn_metadata_mode``, which keeps torch-function metadata out of the trace's way,
    came after 2.4)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    taken = inspect.signature(make_fx).parameters
    return {k: v for k, v in {"_disable_torch_fn_metadata_mode": True}.items() if k in taken}
