"""What compiling with ``torch.compile`` found, in csframework's words: the graph breaks Dynamo reports (the
user's line, what the construct is and its fix), a C++ compiler that is missing or fails, Inductor's errors as one
line; ``Recorder`` is the backend handed to ``torch.compile`` that collects them."""
from __future__ import annotations

import linecache
import os
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch

from ...compat import cpp_compiler
from .mutation import StateChange, state_changes


def one_line(error: BaseException) -> str:
    """``error`` as one line of at most 300 characters, its type first."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 300 else text[:297] + "..."


#: The setting that names the C++ compiler Inductor builds CPU code with.
COMPILER_SETTING = "CXX"
#: Inductor's errors of a C++ compiler that is missing or fails (their names, as in a failure's one line).
COMPILER_ERRORS = ("InvalidCxxCompiler", "CppCompileError")


def missing_compiler() -> str | None:
    """Why Inductor cannot build C++ on this machine (one line naming ``CXX`` and the fix), or ``None``: it looks
    for ``$CXX`` (else ``g++`` on ``PATH``) and runs it."""
    try:
        cpp_compiler()
    except Exception as e:
        return compiler_failure(one_line(e))
    return None


def compiler_failure(reason: str) -> str:
    """``reason`` (a compiler's failure) with the setting to fix."""
    given = os.environ.get(COMPILER_SETTING)
    setting = (f"{COMPILER_SETTING}={given}" if given
               else f"{COMPILER_SETTING} is unset (Inductor looks for g++ on PATH)")
    return (f"no working C++ compiler for Inductor: {setting}: {reason}; set {COMPILER_SETTING} to a C++ compiler "
            "(g++ or clang++)")


@dataclass
class GraphBreak:
    """Where and why Dynamo split a compiled function."""
    where: str  # "file:line" of the user's code, or "" when none is the user's
    reason: str  # one line

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}" if self.where else self.reason


#: The usual graph breaks: words of Dynamo's reason or of the user's line, what the construct is, and its fix.
CONSTRUCTS = ((("item()", "tensor.item"), "`.item()` reads a tensor's value on the host",
               "keep the value a tensor (torch.where for a choice), or read it in a hook outside the step "
               "(on_train_step_end)"),
              (("data-dependent", "could not guard", "generic_jump"), "Python control flow on a tensor's value",
               "use torch.where instead of a Python branch on a tensor's value, or move the check to a hook outside "
               "the step (on_train_step_end)"),
              (("print",), "print() inside the compiled code",
               "remove the print from the forward, or log from a hook outside the step"))
OTHER_FIX = "move that code out of the model's forward (into a hook outside the step) or make it a tensor operation"


def _internal(filename: str) -> bool:
    """Frames of torch, csframework and Python itself are not the user's."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # csframework/
    return (filename.startswith(here) or f"{os.sep}torch{os.sep}" in filename or "<" in filename
            or f"{os.sep}lib{os.sep}python" in filename and "site-packages" not in filename)


def describe_break(reason: str, stack: list) -> GraphBreak:
    """Dynamo's reason for a graph break and the user's stack there, as the user's line and one line saying
    what the construct there is and its fix (Dynamo's own words where the construct is not a usual one)."""
    frame = next((f for f in reversed(stack) if not _internal(f.filename)), stack[-1] if stack else None)
    where = f"{frame.filename}:{frame.lineno}" if frame is not None else ""
    code = ((frame.line or linecache.getline(frame.filename, frame.lineno)) if frame is not None else "").strip()
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    # Dynamo's first line says only that it was a call; the next names what could not be traced
    useful = [ln for ln in lines if not ln.startswith(("Encountered graph break", "Developer debug context",
                                                        "For more details", "Hint: "))]
    text = " ".join((useful or lines or ["unknown"])[:2])
    words = f"{text} {code}".lower()
    construct, fix = next(((what, fix) for keys, what, fix in CONSTRUCTS if any(k in words for k in keys)),
                          (text if len(text) <= 240 else text[:237] + "...", OTHER_FIX))
    return GraphBreak(where, (f"`{code}`: " if code else "") + f"{construct}; fix: {fix}")


class Recorder:
    """The backend handed to ``torch.compile``: Inductor with ``mode``'s options, counting what it compiles and
    the graph breaks Dynamo reports with each graph; a training graph that changes a parameter or buffer of
    ``model`` in place runs eagerly instead (``mutation``), recorded in ``state_changes``."""

    def __init__(self, mode: str, model: torch.nn.Module | None = None):
        import torch._inductor

        self.options = torch._inductor.list_mode_options(mode)
        self.breaks: list[GraphBreak] = []
        self.graphs = 0
        self.failed: str | None = None
        self.model = model
        self.state_changes: list[list[StateChange]] = []  # per graph run eagerly, each set of modules once
        self.unchecked: list[str] = []  # why a graph could not be checked for state changes (it compiled)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            found = describe_break(str(reason.reason), list(reason.user_stack or []))
            if all(str(b) != str(found) for b in self.breaks):
                self.breaks.append(found)
        self.graphs += 1
        if self._changes_state(gm, example_inputs):
            return gm.forward  # Dynamo's captured operations, run eagerly (torch's "eager" backend)
        return cast(Callable, compile_fx(gm, example_inputs, config_patches=self.options))

    def _changes_state(self, gm: torch.fx.GraphModule, example_inputs: list) -> bool:
        if self.model is None:
            return False
        try:
            changes = state_changes(gm, example_inputs, self.model)
        except Exception as e:  # an operation without a fake-tensor kernel: compiled as before, and said
            self.unchecked.append(f"{one_line(e)}; that graph is compiled without the check")
            return False
        # said once per change: each layer of a region may be a graph of its own (each buffer is another input)
        if changes and all({c.key() for c in changes} != {c.key() for c in seen} for seen in self.state_changes):
            self.state_changes.append(changes)
        return bool(changes)


def signature(batch: Any) -> tuple:
    """The shapes and dtypes of a batch's tensors (what a recompilation is reported with)."""
    from torch.utils import _pytree as pytree

    return tuple((tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in pytree.tree_leaves(batch)
                 if isinstance(t, torch.Tensor))


def compile_failure(error: BaseException) -> str | None:
    """One line for an error of compiling (not of running the user's code), else ``None``."""
    from torch._dynamo.exc import BackendCompilerFailed

    if not isinstance(error, BackendCompilerFailed):
        return None
    return one_line(error.inner_exception if getattr(error, "inner_exception", None) is not None else error)
