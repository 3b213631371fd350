"""csframework: a declarative PyTorch training framework on Hydra, with pluggy hooks and a CSX emulator.

    import csframework as csf
    cfg = csf.compose(["device=csx", "loop.max_steps=50"])
    summary = csf.Run(cfg, plugins=[MyPlugin()]).fit()
    model.load_state_dict(csf.load_checkpoint("outputs/my-run", which="best").model)
    model = csf.load_model("outputs/my-run", which="best")  # rebuilt from the checkpoint's own config

Importing the package loads only the errors and the hook markers; ``Run``, ``compose``, the rest and even
``__version__`` load on first use, so ``csframework.config`` (the schemas) can be imported without the
plugin system, and the CSX low-level API (``csf.backend``, ``csf.compile``, ``csf.trace``,
``csf.step_closure``, from ``csframework.backends.csx.lowlevel``) without loading the tracer before it is used.
"""
from __future__ import annotations

import importlib

from .errors import (CheckpointNotFound, CheckpointWriteError, CompileError, ConfigError, CsfError, DamagedCheckpoint,
                     ExitCode, ModelError, NonFiniteLossError, PluginError, TracingError, ValidationError)
from .hookspecs import hookimpl, hookspec

#: Public names loaded on first use: name -> module.
_LAZY = {"Run": ".run", "compose": ".api", "RunConfig": ".config", "RunState": ".state",
         "Interrupted": ".signals", "load_checkpoint": ".weights", "load_model": ".weights",
         "Checkpoint": ".weights",
         # the CSX low-level API for custom loops, mirroring cerebras.pytorch (cstorch.backend, cstorch.compile ...)
         "backend": ".backends.csx.lowlevel", "compile": ".backends.csx.lowlevel",
         "trace": ".backends.csx.lowlevel", "step_closure": ".backends.csx.lowlevel"}

__all__ = ["Run", "RunConfig", "RunState", "compose", "hookimpl", "hookspec", "CsfError", "ConfigError",
           "ValidationError", "PluginError", "TracingError", "CompileError", "NonFiniteLossError",
           "ModelError", "CheckpointWriteError", "DamagedCheckpoint", "CheckpointNotFound", "ExitCode",
           "Interrupted", "load_checkpoint", "load_model", "Checkpoint", "backend", "compile", "trace", "step_closure",
           "__version__"]


def __getattr__(name: str):
    """The lazily loaded names (``__version__`` too: reading the installed metadata is not free)."""
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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
