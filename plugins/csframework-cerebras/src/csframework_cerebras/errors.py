"""cstorch's errors as csframework's one-line errors: a tracer error (its message for ``.item()`` carries a C++
stack dump) names the user's file and line, as the emulator's do; the missing cluster names
``cerebras.mgmt_address``."""
from __future__ import annotations

import os
import traceback

from csframework.errors import CsfError, TracingError

_SKIP = tuple(os.sep + part + os.sep for part in ("torch", "cerebras", "csframework", "csframework_cerebras",
                                                  "pluggy", "hydra"))
_SHIPPED = (os.sep + "csframework" + os.sep + "models.py", os.sep + "csframework" + os.sep + "defaults" + os.sep)


def _users(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not torch, cstorch, csframework or this package (the models
    csframework ships are the user's code of a run)."""
    if filename.startswith("<"):
        return False
    if any(part in filename for part in _SHIPPED):
        return True
    return not any(part in filename for part in _SKIP) and "importlib" not in filename


def user_line(error: BaseException) -> str | None:
    """``file:line in function: `code``` of the innermost frame of the user's code in ``error``'s traceback."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _users(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": `{f.line.strip()}`" if f.line else "")


def first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message, without a C++ stack dump."""
    for line in str(error).splitlines():
        line = line.strip()
        if line and not line.startswith(("Exception raised from", "frame #")):
            return line
    return type(error).__name__


def cluster_problem(error: BaseException) -> str | None:
    """cstorch's complaint that no cluster is configured (``ClusterConfigError``), on one line; else ``None``."""
    for e in (error, error.__cause__, error.__context__):
        if e is not None and (type(e).__name__ == "ClusterConfigError" or "mgmt_address" in str(e)):
            return first_line(e)
    return None


_VALUE_READS = ("_local_scalar_dense", "item()", ".item", "tolist", "data-dependent", "Data-dependent")


def translate(error: BaseException) -> BaseException:
    """A ``TracingError`` naming the user's line for an error raised in the traced step; csframework's own
    errors, and errors outside any user code, as they are."""
    if isinstance(error, CsfError):
        return error
    where = user_line(error)
    if where is None:
        return error
    message = first_line(error)
    fix = ("the real tracer cannot read a tensor's value inside the step: use torch.where, or read it in a "
           "@cstorch.step_closure" if any(k in str(error) for k in _VALUE_READS)
           else "the real tracer (cerebras.pytorch) cannot trace it")
    return TracingError(f"{where}: {type(error).__name__}: {message}; {fix}")
