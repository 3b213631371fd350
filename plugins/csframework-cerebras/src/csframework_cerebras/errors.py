"""cstorch's errors as csframework's one-line errors: a tracer error (its message for ``.item()`` carries a C++
stack dump) names the user's file and line, as the emulator's do (an error of the backward pass, where no
user code is on the stack, names the step's line); a lowering failure cstorch only writes to a file
(``traceback_*.json``) is raised the same way; the missing cluster names ``cerebras.mgmt_address``."""
from __future__ import annotations

import json
import linecache
import os
import re
import sys
import traceback
from pathlib import Path

from csframework.errors import CsfError, TracingError

_SKIP = tuple(os.sep + part + os.sep for part in ("torch", "cerebras", "csframework", "csframework_cerebras",
                                                  "pluggy", "hydra"))
_SHIPPED = (os.sep + "csframework" + os.sep + "models.py", os.sep + "csframework" + os.sep + "defaults" + os.sep)
_STEP = os.sep + "csframework" + os.sep + "step.py"

_VALUE_READS = ("_local_scalar_dense", "item()", ".item", "tolist", "data-dependent", "Data-dependent",
                "materialize a tensor")
#: What cstorch's lazy tracer and lowering say of an operation whose output shape depends on the values.
_SHAPE_OPS = ("aten::nonzero", "aten.nonzero", "aten::unique", "aten.unique", "aten::masked_select",
              "aten.masked_select", "dynamic output shape")
_NO_SHAPE_FUNCTION = re.compile(r"compute_shape_(\w+)")


def _users(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not torch, cstorch, csframework or this package (the models
    csframework ships are the user's code of a run)."""
    if filename.startswith("<"):
        return False
    if any(part in filename for part in _SHIPPED):
        return True
    return not any(part in filename for part in _SKIP) and "importlib" not in filename


def _place(filename: str, lineno, function: str, code: str | None) -> str:
    return f"{filename}:{lineno} in {function}" + (f": `{code.strip()}`" if code and code.strip() else "")


def user_line(error: BaseException) -> str | None:
    """``file:line in function: `code``` of the innermost frame of the user's code in ``error``'s traceback,
    else of csframework's step sequence (the backward pass runs no user code)."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if _users(f.filename)] or [f for f in frames if f.filename.endswith(_STEP)]
    if not mine:
        return None
    f = mine[-1]
    return _place(f.filename, f.lineno, f.name, f.line)


def first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message, without a C++ stack dump (a long one: its first
    sentence; a missing lazy shape function: named)."""
    text = str(error)
    missing = _NO_SHAPE_FUNCTION.search(text)
    if missing:
        return f"cstorch's lazy tracer has no shape function for aten::{missing.group(1)}"
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Exception raised from", "frame #")):
            if len(line) > 160 and ". " in line:
                line = line[:line.index(". ") + 1]
            return line
    return type(error).__name__


def _fix(text: str) -> str:
    if any(k in text for k in _SHAPE_OPS):
        return ("an operation whose output shape depends on tensor values has no static graph: use torch.where or "
                "a multiplicative mask instead of boolean indexing, nonzero() or unique()")
    if any(k in text for k in _VALUE_READS):
        return ("the real tracer cannot read a tensor's value inside the step: use torch.where, or read it in a "
                "@cstorch.step_closure")
    return "the real tracer (cerebras.pytorch) cannot trace it: replace the operation with supported ones"


def cluster_problem(error: BaseException) -> str | None:
    """cstorch's complaint that no cluster is configured (``ClusterConfigError``), on one line; else ``None``."""
    for e in (error, error.__cause__, error.__context__):
        if e is not None and (type(e).__name__ == "ClusterConfigError" or "mgmt_address" in str(e)):
            return first_line(e)
    return None


def translate(error: BaseException) -> BaseException:
    """A ``TracingError`` naming the user's line for an error raised in the traced step; csframework's own
    errors, and errors outside any user code or step, as they are."""
    if isinstance(error, CsfError):
        return error
    where = user_line(error)
    if where is None:
        return error
    return TracingError(f"{where}: {type(error).__name__}: {first_line(error)}; {_fix(str(error))}")


def lowering_error(executor_dir: Path) -> TracingError | None:
    """The step cstorch traced but could not lower to Cerebras IR (an operation without a Cerebras lowering),
    as one line naming the user's line, from the ``traceback_*.json`` cstorch leaves in the executor's
    directory; ``None`` if it left none. (cstorch itself then still reports a validate_only run as validated,
    and a compile_only run stops at the missing cluster.)"""
    for path in sorted(Path(executor_dir).glob("traceback_*.json")):
        try:
            with open(path, "rb") as f:
                report = json.loads(f.read(1 << 22))
            frames = [f for f in report.get("traceback", []) if isinstance(f, dict)]
            message = str(report.get("message", "")).strip() or "the lowering failed"
        except (OSError, ValueError, AttributeError):
            continue
        where = "the traced step"
        for frame in reversed(frames):
            name, line = str(frame.get("filename", "")), frame.get("line")
            found = next((Path(p) / name for p in sys.path if p and (Path(p) / name).is_file()), Path(name))
            if _users(str(found.absolute())):
                where = _place(str(found), line, str(frame.get("function")),
                               linecache.getline(str(found), int(line or 0)))
                break
        return TracingError(f"{where}: cstorch could not lower it to Cerebras IR: {message} ({path}); "
                            f"{_fix(message)}")
    return None
