"""The errors csframework raises on purpose. The CLI prints them without a traceback."""
from __future__ import annotations


class CsfError(Exception):
    """Base class: an error whose message is meant for the user as it is."""

    exit_code = 1


class ConfigError(CsfError):
    """The composed config is invalid: a wrong key, type or value. The message names the key."""

    exit_code = 2


class ValidationError(ConfigError):
    """The validation plugins rejected the run. ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid run:\n" + "\n".join(f"  - {p}" for p in self.problems))


class PluginError(CsfError):
    """A plugin failed to import, or raised inside a hook (``SystemExit`` included), or returned or stored
    something the framework cannot use. Names the plugin and the hook."""

    def __init__(self, plugin: str, hook: str | None, error: BaseException):
        self.plugin, self.hook, self.error = plugin, hook, error
        if isinstance(error, CsfError):  # e.g. a ConfigError found by a plugin keeps its exit status
            self.exit_code = error.exit_code
        where = f"plugin '{plugin}'" + (f" in hook '{hook}'" if hook else "")
        super().__init__(f"{where} failed: {type(error).__name__}: {error}")


class ReadOnlyConfigError(CsfError, AttributeError):
    """A setting of a running run's config was changed (``run.config`` is read-only from validation on).
    Raised in a hook, it fails the run as a ``PluginError`` naming the plugin (exit 1)."""


class TracingError(CsfError):
    """CSX: the traced step did something a static graph cannot express (names the user's line)."""


class CompileError(CsfError):
    """CSX: the graph changed between iterations, or the step cannot be compiled."""


class NonFiniteLossError(CsfError):
    """The loss became NaN or infinite; the message names the step."""


class DataTimeoutError(CsfError):
    """A data-loader worker gave no batch within ``data.timeout_s``; the message names the worker."""
