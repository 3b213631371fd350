"""csframework: a declarative PyTorch training framework on Hydra, with pluggy hooks and a CSX emulator.

    import csframework as csf
    cfg = csf.compose(["device=csx", "loop.max_steps=50"])
    summary = csf.Run(cfg, plugins=[MyPlugin()]).fit()
    model.load_state_dict(csf.load_checkpoint("outputs/my-run", which="best").model)
    model = csf.load_model("outputs/my-run", which="best")  # rebuilt from the checkpoint's own config

Importing the package loads only the errors and the hook markers; ``Run``, ``compose``, the rest and even
``__version__`` load on first use, so ``csframework.config`` (the schemas) can be imported without the
plugin system, and ``csframework.csx`` (the CSX low-level API: ``backend``, ``compile``, ``trace``,
``step_closure``) without loading the tracer before it is used.
"""
from __future__ import annotations

import importlib
import warnings

from .errors import (CheckpointNotFound, CheckpointWriteError, CompileError, ConfigError, CsfError, DamagedCheckpoint,
                     ExitCode, ModelError, NonFiniteLossError, PluginError, TracingError, ValidationError)
from .hookspecs import hookimpl, hookspec

#: Public names loaded on first use: name -> module.
_LAZY = {"Run": ".run", "compose": ".api", "RunConfig": ".config", "RunState": ".state",
         "Interrupted": ".signals", "load_checkpoint": ".weights", "load_model": ".weights",
         "Checkpoint": ".weights"}
_MOVED_TO_CSX = ("backend", "compile", "trace", "step_closure")

__all__ = ["Run", "RunConfig", "RunState", "compose", "hookimpl", "hookspec", "CsfError", "ConfigError",
           "ValidationError", "PluginError", "TracingError", "CompileError", "NonFiniteLossError",
           "ModelError", "CheckpointWriteError", "DamagedCheckpoint", "CheckpointNotFound", "ExitCode", "Interrupted",
           "load_checkpoint", "load_model", "Checkpoint", "csx", "__version__"]


def __getattr__(name: str):
    """The lazily loaded names (``__version__`` too: reading the installed metadata is not free);
    ``csf.backend`` & co. (moved to ``csf.csx``) with a deprecation warning."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("csframework")
        except PackageNotFoundError:  # a source tree that was not installed
            value = "0+unknown"
        globals()[name] = value
        return value
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if name == "csx":
        return importlib.import_module(".csx", __name__)
    if name in _MOVED_TO_CSX:
        warnings.warn(f"csframework.{name} moved to csframework.csx.{name}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(".csx", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
