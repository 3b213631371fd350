"""The errors csframework raises on purpose (the CLI prints them without a traceback), each with its
``ExitCode``, ``one_line``, which puts any error's message on one line, and ``clipped``, which bounds what a
message repeats of an input."""
from __future__ import annotations

import enum
import re


class ExitCode(enum.IntEnum):
    """The exit status of ``python -m csframework`` (a run or a sweep), and ``RunResult.exit_code`` of
    ``csframework.testing``: every status csframework decides is one of these (docs/reference/cli.md)."""

    #: the run completed, ``mode=check`` passed, every job of a sweep completed
    OK = 0
    #: a run failed: the user's code raised at some step, a non-finite loss, a tracing error, a checkpoint
    #: write failed; a sweep with a failed or refused job
    FAILED = 1
    #: a bad config or a rejected run (nothing trained): the config, the command line or the user's
    #: ``model.forward`` is to change
    CONFIG_ERROR = 2
    #: stopped by SIGINT (128 + 2) after finishing a step and saving a checkpoint
    INTERRUPTED = 130
    #: stopped by SIGTERM (128 + 15) after finishing a step and saving a checkpoint
    TERMINATED = 143

_HYDRA_NOISE = re.compile(r",? *set env var HYDRA_FULL_ERROR=1 to see chained exception\.?")


def one_line(error: BaseException | str) -> str:
    """An error's message on one line (Hydra's and instantiate's span several; Hydra's advice to set
    ``HYDRA_FULL_ERROR`` is dropped: ``debug=true`` is csframework's switch)."""
    return " ".join(part.strip() for part in _HYDRA_NOISE.sub("", str(error)).splitlines() if part.strip())


#: Characters that would move the cursor, end a line or recolour a terminal: C0 and C1 controls, DEL and
#: the Unicode bidirectional overrides (which reorder what is shown).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` safe for one console line: control characters from plugins, data or files are shown as
    escapes (``\\n``, ``\\x1b``), so they cannot forge a line, hide one or restyle the terminal."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


#: The most characters of one input (a name, a path, a value the user gave) that a message repeats.
SHOWN_CHARS = 400


def clipped(text: object, limit: int = SHOWN_CHARS) -> str:
    """``str(text)`` for a message, at most about ``limit`` characters: a longer input keeps its start and end
    and says how long it was (``'step-0000...0001' (5006 characters)``), so no message grows with its input."""
    text = str(text)
    if len(text) <= limit:
        return text
    half = max(limit // 2 - 2, 1)
    return f"{text[:half]}...{text[-half:]} ({len(text)} characters)"


def clipped_words(message: str, limit: int = SHOWN_CHARS) -> str:
    """``message`` with each word (a run of non-blanks: a path, a value, a name) longer than ``limit`` clipped:
    what the CLI prints of any error, however the message was built, repeats no input at unbounded length."""
    return re.sub(rf"\S{{{limit + 1},}}", lambda m: clipped(m.group(), limit), message)


class CsfError(Exception):
    """Base class: an error whose message is meant for the user as it is. Whoever builds the message, it
    repeats no input at unbounded length: each word over ``SHOWN_CHARS`` is clipped (``clipped_words``)."""

    #: the CLI's exit status for this error (a class's own, or given to the constructor, never changed later)
    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, *args: object) -> None:
        super().__init__(*(clipped_words(a) if isinstance(a, str) else a for a in args))


class ConfigError(CsfError):
    """The composed config is invalid: a wrong key, type or value. The message names the key."""

    exit_code = ExitCode.CONFIG_ERROR


class ValidationError(ConfigError):
    """The validation plugins rejected the run. ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid run:\n" + "\n".join(f"  - {p}" for p in self.problems))


class PluginError(CsfError):
    """A plugin failed to import, or raised inside a hook (``SystemExit`` included), or returned or stored
    something the framework cannot use. Names the plugin and the hook. Its exit status is ``exit_code``
    if given, else that of ``error`` when csframework raised it on purpose (a ``ConfigError`` a plugin
    found stays 2), else ``FAILED``."""

    def __init__(self, plugin: str, hook: str | None, error: BaseException, exit_code: ExitCode | None = None):
        self.plugin, self.hook, self.error = plugin, hook, error
        if exit_code is None:
            exit_code = error.exit_code if isinstance(error, CsfError) else ExitCode.FAILED
        self.exit_code = exit_code
        where = f"plugin '{plugin}'" + (f" in hook '{hook}'" if hook else "")
        super().__init__(f"{where} failed: {type(error).__name__}: {error}")


class ReadOnlyConfigError(CsfError, AttributeError):
    """A setting of a running run's config was changed (``run.config`` is read-only from validation on).
    Raised in a hook, it fails the run as a ``PluginError`` naming the plugin (exit 1)."""


class RankLostError(CsfError):
    """Under torchrun: another rank died or stopped answering (a collective failed or timed out)."""


class PluginImportError(PluginError):
    """A plugin that could not be imported or instantiated: says where it came from and how to turn it off.
    ``exit_code``: ``CONFIG_ERROR`` for one the config names (``plugins.enable``: nothing ran)."""

    def __init__(self, plugin: str, source: str, error: BaseException, fix: str,
                 exit_code: ExitCode | None = None):
        super().__init__(plugin, None, error, exit_code)
        self.args = (f"plugin '{plugin}' ({source}) failed to load: {type(error).__name__}: {error}; {fix}",)


class TracingError(CsfError):
    """CSX: the traced step did something a static graph cannot express (names the user's line)."""


class CompileError(CsfError):
    """CSX: the graph changed between iterations, or the step cannot be compiled."""


class ModelError(CsfError):
    """``model.forward`` returned a loss that cannot be trained on (a vector, an integer, a number, one
    outside the autograd graph): found when its backward fails (the first step), named ``model.forward``
    with what it returned; or no loss at all (a dict without ``loss``: the message names its keys). Exit status 2, as a bad config's: the user's code is to change."""

    exit_code = ExitCode.CONFIG_ERROR


class NonFiniteLossError(CsfError):
    """The loss became NaN or infinite; the message names the step."""


class CheckpointWriteError(CsfError):
    """A checkpoint could not be written (disk full, permissions ...); the previous ones are intact."""


class DamagedCheckpoint(CsfError, ValueError):
    """A checkpoint directory is incomplete, fails its checksums, or holds something other than data. The
    message names the checkpoint and the file."""


class CheckpointNotFound(CsfError, FileNotFoundError):
    """``csf.load_checkpoint``: the path is no checkpoint, checkpoints/ or run directory, or the run has no
    checkpoint that ``which`` names (none yet, no best kept, no such step). The message names the path and
    what it holds."""

    exit_code = ExitCode.CONFIG_ERROR


class UnreadableCheckpoints(ConfigError):
    """``checkpoints/`` exists but cannot be listed (permissions, or a file where the directory should be)."""


class RunDirInUse(ConfigError):
    """Another process holds the run directory's lock; the message names it (PID, host, start time)."""


class RunDirHoldsRun(ConfigError):
    """A fresh run, or a checkpoint of another run, was asked for in a run directory that holds a run
    (``checkpoint.start_over`` not set), or ``start_over`` could not move that run aside (nothing moved): the
    message names the directory (and the entry) and the ways on (continue it, another directory, start over)."""


class DataTimeoutError(CsfError):
    """A data-loader worker gave no batch within ``data.timeout_s``; the message names the worker."""


class UnsafePathError(CsfError):
    """A path in a run or sweep directory is not what csframework writes there (a link, a FIFO, a file
    where a directory belongs, a hard link): refused, never followed. Names the path and the fix."""

    exit_code = ExitCode.CONFIG_ERROR


class DataError(CsfError, ValueError):
    """A dataset, its ``__getbatch__`` or a ``collate_fn`` gave something that is no batch: the message
    names the key (``data.train``/``data.val``) and the function. A ``ValueError`` as well, as the checks
    it replaces raised."""


class WrongProcessError(CsfError):
    """A method of a run was called in a process other than the run's own (a data-loader worker, a child a
    plugin forked), where it could not take effect; ``run.request_stop`` from a ``Dataset``, say."""
