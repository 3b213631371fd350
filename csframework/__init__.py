"""csframework: a declarative PyTorch training framework on Hydra, with pluggy hooks and a CSX emulator.

    import csframework as csf
    cfg = csf.compose(["device=csx", "loop.max_steps=50"])
    summary = csf.Run(cfg, plugins=[MyPlugin()]).fit()

The CSX low-level API (``backend``, ``compile``, ``trace``, ``step_closure``) is ``csframework.csx``;
it is imported on first use, so ``import csframework`` does not load the tracer.
"""
from __future__ import annotations

import importlib
import warnings
from importlib.metadata import PackageNotFoundError, version as _version

from .api import compose
from .config import RunConfig
from .errors import (CheckpointWriteError, CompileError, ConfigError, CsfError, NonFiniteLossError, PluginError,
                     TracingError, ValidationError)
from .hookspecs import hookimpl, hookspec
from .run import Run
from .signals import Interrupted
from .state import RunState

try:
    __version__ = _version("csframework")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["Run", "RunConfig", "RunState", "compose", "hookimpl", "hookspec", "CsfError", "ConfigError",
           "ValidationError", "PluginError", "TracingError", "CompileError", "NonFiniteLossError",
           "CheckpointWriteError", "Interrupted", "csx", "__version__"]

_MOVED_TO_CSX = ("backend", "compile", "trace", "step_closure")


def __getattr__(name: str):
    """``csf.csx`` on first use; ``csf.backend`` & co. (moved to ``csf.csx``) with a deprecation warning."""
    if name == "csx":
        return importlib.import_module(".csx", __name__)
    if name in _MOVED_TO_CSX:
        warnings.warn(f"csframework.{name} moved to csframework.csx.{name}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(".csx", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
