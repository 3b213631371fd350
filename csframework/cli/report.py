"""What the CLI prints for an error csframework raises on purpose: one line per problem, no traceback."""
from __future__ import annotations

import sys

from .. import command
from ..errors import CsfError, ValidationError, clipped_words, one_line, printable


def error_lines(error: CsfError) -> list[str]:
    """The report of ``error``, one line per problem: ``csframework: error: <message>``, or for a run the
    validation rejected on several counts, ``csframework: error: invalid run:`` then ``  - <problem>``."""
    if isinstance(error, ValidationError) and len(error.problems) > 1:
        return ["csframework: error: invalid run:"] + [f"  - {one_line(p)}" for p in error.problems]
    if isinstance(error, ValidationError) and error.problems:
        return [f"csframework: error: invalid run: {one_line(error.problems[0])}"]
    return [f"csframework: error: {one_line(str(error)) or type(error).__name__}"]


def report_error(error: CsfError) -> None:
    """``error_lines`` on stderr."""
    sys.stderr.write("".join(printable(clipped_words(line)) + "\n" for line in error_lines(error)))
    sys.stderr.flush()


def interrupted_line(error: KeyboardInterrupt) -> str:
    """What the CLI says when a run stopped on a signal: what happened and the whole command that continues
    the run (the command as typed, with ``checkpoint.resume=auto`` and this run's directory)."""
    from hydra.core.hydra_config import HydraConfig

    reason = getattr(error, "reason", None) or str(error)
    line = f"csframework: interrupted: {reason}" if reason else "csframework: interrupted"
    if HydraConfig.initialized():
        line += f"; continue with: {command.continue_command(HydraConfig.get().runtime.output_dir)}"
    return line
