"""Graceful stop on SIGTERM and SIGINT while ``Run.fit`` trains.

The first signal only records itself in the run's state (``RunState.request_stop``); the loop acts on it at the next step
boundary: the step finishes, the checkpoint plugin saves, ``summary.json`` says ``interrupted`` and
``Run.fit`` raises :class:`Interrupted` (the CLI exits with ``ExitCode.INTERRUPTED``, 130, for SIGINT and
``ExitCode.TERMINATED``, 143, for SIGTERM: 128 + the signal number). A second signal to this process exits
at once with the same status and no clean-up; every file csframework writes is replaced atomically, so
nothing on disk is half-written by that exit. Under torchrun a stop the ranks agreed on for another rank's
signal is not this process's first signal: when that rank exits, torchrun sends SIGTERM to the others,
and rank 0, still saving the checkpoint and ``summary.json`` of the stop, finishes them.

Handlers are installed only for the duration of ``fit`` and only in the main thread (Python delivers
signals there); the previous handlers are restored afterwards.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import TYPE_CHECKING

from .errors import ExitCode

if TYPE_CHECKING:
    from .state import RunState

#: Signals that ask a run to stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_status(signum: int | None) -> ExitCode:
    """The exit status of a run or sweep that ``signum`` stopped: ``TERMINATED`` for SIGTERM, else
    ``INTERRUPTED`` (SIGINT, or a stop whose signal is not known)."""
    return ExitCode.TERMINATED if signum == signal.SIGTERM else ExitCode.INTERRUPTED


_caught: list[int] = []  # the stop signals ``stop_on_signals`` caught in this process, newest last


def caught_stop_signal() -> int | None:
    """The last SIGINT/SIGTERM ``stop_on_signals`` caught in this process since ``forget_stop_signals``
    (None if none): one that came after the loop's last step (during the final checkpoint) ends ``fit``
    as ``completed``, and a caller running several fits (a sweep job) must still stop."""
    return _caught[-1] if _caught else None


def forget_stop_signals() -> None:
    _caught.clear()


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal after finishing a step (a ``KeyboardInterrupt``, so code that treats
    Ctrl-C as an interruption treats this one the same way). ``exit_code`` is the CLI's exit status."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        self.exit_code = exit_status(signum)
        #: what happened, without the hint (the CLI adds the whole command that continues the run)
        self.reason = f"stopped by {signal_name(signum)} after step {step}"
        super().__init__(f"{self.reason}; continue with checkpoint.resume=auto in the same run directory")


@contextlib.contextmanager
def stop_on_signals(state: RunState):
    """While active, SIGINT/SIGTERM record a stop request in ``state`` once and exit the process on the
    second."""
    state.reset_stop()
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    received: list[int] = []  # the signals this process got while active (not a stop agreed for another rank's)

    def handler(signum, frame):
        _caught.append(signum)
        if not received:
            received.append(signum)
            state.request_stop(signum)  # (a stop already agreed on, for another rank's signal, stays as it is)
            with contextlib.suppress(OSError):  # os.write: safe where the buffered streams are not
                os.write(2, f"\ncsframework: {signal_name(signum)}: finishing the current step, saving a "
                            "checkpoint, then stopping (send it again to exit at once)\n".encode())
            return
        # Second signal: leave now. os.write and os._exit are safe here; buffered files are not.
        message = f"csframework: {signal_name(signum)} again: exiting now without saving\n"
        try:
            os.write(2, message.encode())
        finally:
            os._exit(exit_status(signum))

    previous = {}
    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, handler)
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
