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


def inductor_default_cache_dir() -> str:
    """Inductor's own default cache directory, ``<tmp>/torchinductor_<user>`` (``default_cache_dir``; torch
    2.4 has no such function and computes the same path)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        import getpass
        import os
        import re
        import tempfile

        return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser()))
    return default_cache_dir()


def pick_vec_isa():
    """Inductor's check of the CPU's vector instructions (in ``torch._inductor.cpu_vec_isa``; in ``codecache``
    on torch 2.4)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa as pick
    except ImportError:
        from torch._inductor.codecache import pick_vec_isa as pick
    return pick()


def recompile_limit_key() -> str:
    """The name of Dynamo's limit of recompilations of one function (``recompile_limit``; ``cache_size_limit`` on
    torch 2.4)."""
    import torch._dynamo.config as dynamo_config

    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


def cpp_compiler() -> str:
    """The C++ compiler Inductor builds CPU code with (``$CXX``, else ``g++``), after running it once; raises
    (``InvalidCxxCompiler``) when none runs. ``cpp_builder.get_cpp_compiler`` (``codecache.cpp_compiler`` before
    torch 2.5)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:
        from torch._inductor.codecache import cpp_compiler as get_cpp_compiler  # type: ignore[attr-defined,no-redef]
    return get_cpp_compiler()
