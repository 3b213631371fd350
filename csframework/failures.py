"""A run that fails in the user's code while it runs: an exception raised by their ``forward``, dataset,
``collate_fn`` or a plugin's hook at some step. The CLI reports it in one line (``RunFailed``: where in the
run, which of the user's functions at which file:line, the exception), exit status 1 (a failed run, not a
refused one); the whole traceback goes to the run directory's ``error.txt`` (``write_traceback``), and to
the console with ``debug=true``. Errors csframework raises on purpose (``CsfError``) keep their own line.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from .errors import CsfError, ExitCode, PluginError, UnsafePathError, one_line
from .targets import DEBUG_HINT, internal_file, shown_path

if TYPE_CHECKING:
    from .protocol import RunProtocol

ERROR_FILE = "error.txt"

#: A data-loader worker's error comes back as its type with the worker's traceback as its message
_WORKER_TRACEBACK = "Original Traceback (most recent call last):"
_TRACEBACK_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


class RunFailed(CsfError):
    """The run failed in the user's code (``failure_line`` says where); raised by the CLI from the user's
    exception, which is its ``__cause__``."""


def is_user_failure(error: BaseException) -> bool:
    """Whether ``error`` came from the user's code (or any code that is not csframework's on purpose):
    an exception that is no ``CsfError``, or a plugin's hook that raised one."""
    if isinstance(error, PluginError):
        return type(error) is PluginError and not isinstance(error.error, CsfError)
    return isinstance(error, Exception) and not isinstance(error, CsfError)


def write_traceback(run: RunProtocol, error: BaseException) -> Path | None:
    """Write ``error``'s traceback to the run directory's ``error.txt`` (rank 0; through the safe file layer,
    atomically); returns its path, ``None`` when it could not be written (the run directory refuses it)."""
    if run.rank != 0:
        return None
    text = f"{failure_line(run, error)}\n\n" + "".join(traceback.format_exception(error))
    try:
        return run.files.write(ERROR_FILE, text)
    except (OSError, UnsafePathError) as e:
        run.log.warning("error_file_not_written", path=str(run.output_dir / ERROR_FILE),
                        error=getattr(e, "strerror", None) or str(e))
        return None


def failure_line(run: RunProtocol, error: BaseException) -> str:
    """``<when> failed in <the user's function> (<file>:<line>): <Type>: <message>``: ``when`` is the training
    step (or the evaluation after a step) the error ended, read from the traceback's frames of the loop."""
    cause = error.error if isinstance(error, PluginError) else error
    message, frame = _message(cause), _user_frame(cause)
    where = f"plugin '{error.plugin}', hook '{error.hook}'" if isinstance(error, PluginError) else None
    if frame is not None:
        file, line, function = frame
        where = f"{where or function} ({file}:{line})" if where else f"{function} ({file}:{line})"
    return (f"{_when(run, error)} failed" + (f" in {where}" if where else "") + f": {type(cause).__name__}: {message}"
            + _collate_hint(cause, frame))


#: torch's default ``collate_fn`` (a DataLoader's batching of samples), in a path or a worker's traceback
_DEFAULT_COLLATE = re.compile(r"torch[/\\]utils[/\\]data[/\\]_utils[/\\]collate\.py")


def _collate_hint(error: BaseException, user_frame: tuple | None) -> str:
    """What to change when torch's default collate failed with none of the user's code below it: the samples
    of a batch (tensors of different shapes, say) cannot be stacked into one."""
    if user_frame is not None:
        return ""
    paths = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)]
    if not any(_DEFAULT_COLLATE.search(path) for path in paths) and not (
            _WORKER_TRACEBACK in str(error) and _DEFAULT_COLLATE.search(str(error))):
        return ""
    return ("; torch's default collate could not make a batch of the dataset's samples: return samples of one "
            "shape (pad or crop them), or batch them yourself with data.collate_fn (a function of the list of "
            "samples)")


def error_record(run: RunProtocol, error: BaseException) -> str:
    """``error`` as the run's records say it (``events.jsonl``'s ``<mode>_failed``, ``summary.json``'s
    ``error``): one line, a user failure's ``failure_line``."""
    if is_user_failure(error):
        return failure_line(run, error)
    return f"{type(error).__name__}: {one_line(error)}"


def run_failed(run: RunProtocol, error: BaseException, error_file: Path | None) -> RunFailed:
    """The ``RunFailed`` the CLI reports for ``error`` (a user failure, ``is_user_failure``)."""
    saved = f"the traceback is in {shown_path(str(error_file))} (debug=true prints it)" if error_file else DEBUG_HINT
    return RunFailed(f"{failure_line(run, error)}; {saved}")


#: The loop's files, whose functions a traceback went through say where in the run it was raised.
_LOOP_FILES = tuple(f"csframework{sep}{name}.py" for sep in "/\\" for name in ("loop", "evaluation"))


def _when(run: RunProtocol, error: BaseException) -> str:
    """Where in the run ``error`` was raised, from the functions of the loop its traceback went through."""
    names = {frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)
             if frame.f_code.co_filename.endswith(_LOOP_FILES)}
    step = run.global_step
    if "_evaluate" in names:
        return f"the evaluation at step {step}"
    if "end_step" in names:  # the step is counted: its hooks (on_train_step_end ...) failed
        return f"training step {step}"
    if "train_epoch" in names:
        return f"training step {step + 1}"
    return f"the run at step {step}"


def _message(error: BaseException) -> str:
    """``error``'s message on one line; of a data-loader worker's error, the worker's own message."""
    text = str(error)
    if _WORKER_TRACEBACK in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        return one_line(last.split(": ", 1)[1] if last.startswith(type(error).__name__ + ":") else last)
    return one_line(text)


def _user_frame(error: BaseException) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the innermost frame of ``error``'s traceback in the user's code (see
    ``targets.internal_file``), preferring one outside ``site-packages``; a data-loader worker's traceback
    is read from its message."""
    frames: list[tuple[str, int, str]] = []
    tb: TracebackType | None = error.__traceback__
    for frame, line in traceback.walk_tb(tb):
        code = frame.f_code
        if not internal_file(code.co_filename):
            frames.append((code.co_filename, line, getattr(code, "co_qualname", code.co_name)))
    text = str(error)
    if _WORKER_TRACEBACK in text:
        frames += [(f, int(n), name) for f, n, name in _TRACEBACK_FRAME.findall(text.split(_WORKER_TRACEBACK)[1])
                   if not internal_file(f)]
    own = [f for f in frames if "-packages" not in f[0]]
    if not frames:
        return None
    file, line, function = (own or frames)[-1]
    return shown_path(file), line, function


def leave_if_forked(owner: int, error: BaseException | None = None) -> None:
    """End this process if it is not ``owner`` but a child a plugin forked that came back into the run
    instead of exiting: it must not run the framework's completion or failure paths (``summary.json``,
    checkpoints, ``on_exception``), which are its parent's."""
    if os.getpid() == owner:
        return
    code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) \
        else ExitCode.OK if error is None else ExitCode.FAILED
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
