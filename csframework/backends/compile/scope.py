"""The process-wide torch settings ``backend.compile`` needs, held only while a run uses its compiled step.

A run is a library call, not the owner of the process: in a notebook, the caller's own compiled functions, torch
settings and log handlers read the same after ``fit()`` as before it. ``CompileScope`` sets, from the first
compiled call of a stage until ``close()`` (the end of the stage, of ``fit`` or ``validate``, however it ends):

* ``$TORCHINDUCTOR_CACHE_DIR``: csframework's Inductor cache (``cache_dir()``);
* Dynamo's recompile limit (per code object), above csframework's own bound (``compiled.MAX_RECOMPILES``, per
  compiled function), so that csframework's bound, and its one ``recompile_limit`` warning, come first;
* Inductor's ``cpp.vec_isa_ok`` once the CPU's vector instructions are known to build
  (``trust_vector_isa``);
* torch's compile loggers (``torch._dynamo``, ``torch._inductor``, ...): their records become the run's
  ``torch_log`` events (``events.jsonl``, not the console), so csframework's one line per problem is the only one
  on stderr; ``debug=true`` leaves torch's own lines as they are.

Dynamo's caches are never reset: compiled code is kept per code object, and each stage's runners compile
functions of their own (``fresh``), so an earlier run's entries neither count towards this one's limit nor
disappear from the caller's functions.
"""
from __future__ import annotations

import contextlib
import logging
import os
import types
from pathlib import Path
from typing import Callable

import torch

from ...compat import inductor_default_cache_dir, pick_vec_isa, recompile_limit_key

#: The loggers whose records are compiling's (a record's logger name starts with one of them).
COMPILE_LOGGERS = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch._subclasses", "torch.fx",
                   "torch._guards", "torch._logging", "torch._export")


class _Router(logging.Handler):
    """In place of a torch logger's handlers: compiling's records to ``sink``, any other to those handlers."""

    def __init__(self, sink: Callable[[logging.LogRecord], None], handlers: list[logging.Handler]):
        super().__init__()
        self.sink, self.handlers = sink, handlers

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(COMPILE_LOGGERS):
            self.sink(record)
            return
        for handler in self.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _torch_loggers() -> list[logging.Logger]:
    """torch's loggers that have handlers of their own (torch's logging gives them handlers and no propagation)."""
    named = [logging.getLogger("torch")] + [logger for name, logger in logging.root.manager.loggerDict.items()
                                            if name.startswith("torch.") and isinstance(logger, logging.Logger)]
    return [logger for logger in named if logger.handlers]


def fresh_function(function: Callable) -> Callable:
    """A copy of ``function`` with a code object of its own: Dynamo keeps compiled code, and counts
    recompilations, per code object, so a copy compiled by a new stage's runner starts with none (no global
    reset)."""
    code = function.__code__.replace(co_name=function.__code__.co_name)
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__qualname__ = function.__qualname__
    return copy


def fresh(method: Callable) -> Callable:
    """A bound ``method`` as a function of its own code object (``fresh_function``)."""
    return types.MethodType(fresh_function(method.__func__), method.__self__)  # type: ignore[attr-defined]


class CompileScope:
    """The settings above, set by ``enter()`` (again after ``close()``) and restored by ``close()``."""

    def __init__(self, cache_dir: str, recompile_limit: int, sink: Callable[[logging.LogRecord], None] | None):
        self.cache_dir, self.recompile_limit, self.sink = cache_dir, recompile_limit, sink
        self.vec_isa_ok = False
        self.active = False
        self._stack = contextlib.ExitStack()

    def enter(self) -> None:
        if self.active:
            return
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        self.active = True
        stack = self._stack
        previous = os.environ.get(CACHE_ENV)
        stack.callback(_restore_env, CACHE_ENV, previous)
        os.environ[CACHE_ENV] = self.cache_dir
        stack.enter_context(dynamo_config.patch({recompile_limit_key(): self.recompile_limit}))
        if self.vec_isa_ok:
            stack.enter_context(inductor_config.patch({"cpp.vec_isa_ok": True}))
        if self.sink is not None:
            for logger in _torch_loggers():
                stack.callback(setattr, logger, "handlers", logger.handlers)
                logger.handlers = [_Router(self.sink, logger.handlers)]

    def close(self) -> None:
        """Restore every setting ``enter`` changed (nothing when it was not entered)."""
        self.active = False
        self._stack.close()


CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


#: Where Inductor keeps generated code and built kernels unless ``$TORCHINDUCTOR_CACHE_DIR`` says otherwise.
DEFAULT_CACHE_DIR = "~/.cache/csframework/inductor"


def cache_dir() -> Path:
    """Inductor's cache directory: ``$TORCHINDUCTOR_CACHE_DIR``, else ``~/.cache/csframework/inductor`` (not
    Inductor's default in the temporary directory, which the system may clear). Inductor writes its entries
    atomically under file locks, so concurrent runs (sweep jobs, torchrun ranks) share it safely."""
    given = os.environ.get(CACHE_ENV)
    # Inductor writes its default into the variable once it has looked: that is no user's choice
    if given and os.path.abspath(given) != os.path.abspath(inductor_default_cache_dir()):
        return Path(given)
    return Path(os.path.expanduser(DEFAULT_CACHE_DIR))


def isa_marker_path(root: Path) -> Path:
    """The file saying that Inductor built and ran code for this CPU's vector instructions in cache ``root``."""
    return root / f"csframework-vec-isa-{torch.backends.cpu.get_cpu_capability().lower()}.ok"


def trust_vector_isa(root: Path) -> bool:
    """Check the CPU's vector instructions once per cache, not in every process: Inductor builds and runs test
    programs for it (about 4 s of a cached run's compile time). Returns whether the check passed, here or in an
    earlier run (then ``CompileScope`` sets Inductor's ``cpp.vec_isa_ok``: the check's result is part of
    Inductor's cache keys, so every run, the first included, compiles with it set)."""
    if torch.cuda.is_available():
        return False
    marker = isa_marker_path(root)
    if not marker.is_file():
        if not pick_vec_isa():  # none works: Inductor's own check says so again and builds scalar code
            return False
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:  # a read-only cache: the check runs again next time
            pass
    return True
