"""Tracing errors that name the user's line and the fix (instead of a C++ message about
``aten::_local_scalar_dense``)."""
from __future__ import annotations

import linecache
import os
import sys
import traceback
from types import FrameType

import torch

from ..errors import CompileError, TracingError

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: The framework's directory, from this package's location: its code between the user's step and torch is
#: never "the user's line" ...
_CSF_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: ... except the models it ships, which are the user's code of a run.
_MODELS = (os.path.join(_CSF_DIR, "models.py"), os.path.join(_CSF_DIR, "defaults") + os.sep)
_STDLIB_SKIP = ("contextlib.py", "functools.py", "typing.py")


def is_internal(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return True
    filename = os.path.abspath(filename)
    if filename.startswith(_TORCH_DIR) or (filename.startswith(_CSF_DIR) and not filename.startswith(_MODELS)):
        return True
    if os.sep + "pluggy" + os.sep in filename:
        return True
    return os.path.basename(filename) in _STDLIB_SKIP and filename.startswith(os.path.dirname(os.__file__))


class Where:
    """A place in the user's code: ``file:line in function: `code```."""

    def __init__(self, filename: str, lineno: int, function: str, code: str | None = None):
        self.filename, self.lineno, self.function = filename, lineno, function
        self.code = (code if code is not None else linecache.getline(filename, lineno)).strip()

    def __str__(self) -> str:
        text = f"{self.filename}:{self.lineno} in {self.function}"
        return text + (f": `{self.code}`" if self.code else "")


def user_frame_here(skip: int = 1) -> Where | None:
    """The innermost frame of the caller's stack that is the user's code."""
    frame: FrameType | None = sys._getframe(skip)
    while frame is not None:
        if not is_internal(frame.f_code.co_filename):
            return Where(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


_INTERNAL_CODE: dict = {}


def user_location(skip: int = 1) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the caller's innermost user frame; cheap (cached per code object)."""
    frame: FrameType | None = sys._getframe(skip + 1)
    while frame is not None:
        code = frame.f_code
        internal = _INTERNAL_CODE.get(code)
        if internal is None:
            internal = _INTERNAL_CODE[code] = is_internal(code.co_filename)
        if not internal:
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back
    return None


def called_from(name: str, skip: int = 1, depth: int = 6) -> bool:
    """Whether one of the next ``depth`` callers (torch internals) is a function called ``name``."""
    frame: FrameType | None = sys._getframe(skip + 1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == name and frame.f_code.co_filename.startswith(_TORCH_DIR):
            return True
        frame = frame.f_back
    return False


def user_frame_of(error: BaseException) -> Where | None:
    """The innermost user frame on ``error``'s traceback."""
    found = None
    for fs in traceback.extract_tb(error.__traceback__):
        if not is_internal(fs.filename):
            found = Where(fs.filename, fs.lineno or 0, fs.name, fs.line)
    return found


_FIX_VALUE = ("use torch.where(condition, a, b) to choose inside the graph, or read the value after the "
              "step in a @csf.step_closure function (it runs after each step with real values)")
_WHY = "the traced step runs on placeholder tensors that have no values while it is captured into a static graph"

KINDS = {
    "bool": ("Python control flow on a tensor value", _FIX_VALUE),
    "item": ("`.item()` reads a tensor's value", _FIX_VALUE),
    "tolist": ("`.tolist()` reads a tensor's values", _FIX_VALUE),
    "number": ("converting a tensor to a Python number (int()/float()/index)", _FIX_VALUE),
    "numpy": ("`.numpy()` copies a tensor to the host", _FIX_VALUE),
    "format": ("formatting a tensor's value (f-string with a format spec)", _FIX_VALUE),
    "cpu": ("`.cpu()` / `.to(\"cpu\")` moves a tensor to the host",
            "keep tensors on the device inside the step; read them after the step in a @csf.step_closure "
            "function, or return them from the step"),
    "data": ("an operation needs a tensor's value",
             "use torch.where or masking with static shapes instead, or move the computation into a "
             "@csf.step_closure function"),
    "shape": ("an operation whose output shape depends on tensor values",
              "a static graph needs static shapes: use torch.where or a multiplicative mask instead of "
              "boolean indexing, nonzero() or unique()"),
}


def tracing_error(kind: str, where: Where | None, detail: str = "") -> TracingError:
    what, fix = KINDS[kind]
    place = f" at {where}" if where is not None else ""
    extra = f" ({detail})" if detail else ""
    return TracingError(f"{what}{place}{extra}: {_WHY}. Fix: {fix}.")


def translate(error: BaseException) -> TracingError | None:
    """A ``TracingError`` for torch's fake-tensor failures (data-dependent operations), else None."""
    module = type(error).__module__ or ""
    text = str(error)
    name = type(error).__name__
    if name == "DynamicOutputShapeException" or "dynamic output shape" in text.lower():
        return tracing_error("shape", user_frame_of(error), _op_of(error))
    if _raised_in_torch(error, "tolist"):  # torch 2.4's FakeTensor.tolist fails (asserts) on 2-D and up
        return tracing_error("tolist", user_frame_of(error))
    data_dependent = (name in ("DataDependentOutputException", "GuardOnDataDependentSymNode",
                               "UnsupportedOperatorException")
                      or "_local_scalar_dense" in text or "data-dependent" in text.lower()
                      or "FakeTensor" in text and ("data" in text or "storage" in text))
    if data_dependent and (module.startswith("torch") or isinstance(error, RuntimeError)):
        return tracing_error("data", user_frame_of(error), _op_of(error))
    return None


def _raised_in_torch(error: BaseException, function: str) -> bool:
    """Whether ``error`` went through torch's own function of that name."""
    return any(fs.name == function and fs.filename.startswith(_TORCH_DIR)
               for fs in traceback.extract_tb(error.__traceback__))


def _op_of(error: BaseException) -> str:
    func = getattr(error, "func", None)
    if func is not None:
        return f"operation {func}"
    first = str(error).strip().splitlines()
    return first[0][:160] if first else type(error).__name__


def first_refusal(error: BaseException) -> BaseException | None:
    """The emulator's own refusal (``TracingError``, ``CompileError``) that ``error`` was raised while
    handling, if any."""
    seen = error.__context__
    while seen is not None:
        if isinstance(seen, (TracingError, CompileError)):
            return seen
        seen = seen.__context__
    return None
