"""csframework: a declarative PyTorch training framework on Hydra, with pluggy hooks and a CSX emulator.

    import csframework as csf
    cfg = csf.compose(["device=csx", "loop.max_steps=50"])
    summary = csf.Run(cfg, plugins=[MyPlugin()]).fit()
"""
from .config import RunConfig, compose
from .errors import (CompileError, ConfigError, CsfError, NonFiniteLossError, PluginError, TracingError,
                     ValidationError)
from .lowlevel import backend, compile, step_closure, trace
from .plugins import hookimpl
from .run import Run
from .signals import Interrupted

__version__ = "0.1.0"

__all__ = ["Run", "RunConfig", "compose", "hookimpl", "CsfError", "ConfigError", "ValidationError",
           "PluginError", "TracingError", "CompileError", "NonFiniteLossError", "Interrupted", "backend",
           "compile", "trace", "step_closure", "__version__"]
