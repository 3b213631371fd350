"""Hook dispatch, in one place: every call site calls ``hooks.on_x(run=..., ...)`` and this module decides how.

Each hook's caller is chosen on pluggy's public API only (``get_hookimpls``, ``HookImpl``'s ``function``/
``argnames``/``kwargnames``/``wrapper``/``hookwrapper``, the spec's ``opts``), and chosen again whenever the
manager's registrations change (``register``, ``unregister``, ``set_blocked``, ``add_hookspecs``: a plugin
registered on ``run.hooks.pm`` after the run is built is called, as pluggy would call it):

- a hook nobody implements is a no-op returning what pluggy would (``[]``, or ``None`` for ``firstresult``);
- a hook whose implementations are all plain functions (no wrappers, no optional arguments) calls them
  itself, in pluggy's order with pluggy's results, at about half the cost of pluggy's dispatch (figures in
  docs/performance.md);
- wrappers, a manager whose calls are traced or monitored (``ObservedManager.observed``, set by pluggy's
  public ``enable_tracing``/``add_hookcall_monitoring``), and a manager that is not an ``ObservedManager``
  (it cannot say when its registrations change) go through pluggy as they are.

An exception raised inside an implementation becomes a ``PluginError`` naming the plugin and the hook.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pluggy

from .config.readonly import read_only_error
from .errors import NonFiniteLossError, PluginError

__all__ = ["Hooks", "ObservedManager", "plugin_error"]


class ObservedManager(pluggy.PluginManager):
    """pluggy's manager, remembering whether anyone traces or monitors its hook calls (``observed``: then
    every call goes through pluggy, which does the tracing) and counting the changes of its registrations
    (``generation``: a hook's direct caller is rebuilt when it moves). ``csframework.plugins.build_manager``
    makes one that also checks each plugin's hook implementations as it registers."""

    observed = False
    generation = 0

    def register(self, plugin, name=None):
        try:
            return super().register(plugin, name=name)
        finally:
            self.generation += 1

    def unregister(self, plugin=None, name=None):
        try:
            return super().unregister(plugin=plugin, name=name)
        finally:
            self.generation += 1

    def set_blocked(self, name):
        try:
            return super().set_blocked(name)
        finally:
            self.generation += 1

    def add_hookspecs(self, module_or_class):
        try:
            return super().add_hookspecs(module_or_class)
        finally:
            self.generation += 1

    # observed: every hook's caller (and the loop's list of hooks to skip, ``Hooks.quiet``) is chosen again
    def add_hookcall_monitoring(self, before, after):
        self.observed = True
        self.generation += 1
        return super().add_hookcall_monitoring(before, after)

    def enable_tracing(self):
        self.observed = True
        self.generation += 1
        return super().enable_tracing()


class Hooks:
    """Calls hooks by attribute (``hooks.on_fit_start(run=run)``); see the module's docstring."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        for name in dir(pm.hook):
            if not name.startswith("_"):
                setattr(self, name, _caller(pm, name))

    def __getattr__(self, hook_name: str) -> Callable[..., Any]:
        """A hook whose spec was added after the run was built (``pm.add_hookspecs``)."""
        pm = self.__dict__.get("pm")
        if pm is None or hook_name.startswith("_") or not hasattr(pm.hook, hook_name):
            raise AttributeError(hook_name)
        caller = _caller(pm, hook_name)
        setattr(self, hook_name, caller)
        return caller

    def quiet(self) -> tuple[int | None, frozenset[str]]:
        """``(generation, names)``: the hooks nobody implements, whose calls a loop may skip (each call costs
        a step a few hundred instructions for nothing), as of the manager's ``generation``; the loop asks
        again when ``pm.generation`` moves on. No hook is named (``(None, frozenset())``) when the manager
        cannot say when its registrations change, or when its calls are traced or monitored (pluggy then
        records every call, with or without implementations)."""
        pm = self.pm
        if not isinstance(pm, ObservedManager) or pm.observed:
            return None, frozenset()
        names = frozenset(name for name in dir(pm.hook)
                          if not name.startswith("_") and not getattr(pm.hook, name).get_hookimpls())
        return pm.generation, names

    def each(self, hook_name: str, **kwargs) -> Iterator[tuple[str, Any]]:
        """Call the implementations of ``hook_name`` one at a time, in pluggy's order, yielding
        ``(plugin name, result)`` after each: for results and side effects a caller must attribute to
        the plugin that made them. Errors are wrapped as in a normal call."""
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            yield impl.plugin_name, _call_one(impl, hook_name, kwargs)

    def each_isolated(self, hook_name: str, **kwargs) -> list[tuple[str, Exception]]:
        """Call every implementation of ``hook_name`` even when some raise; returns ``(plugin name, error)``
        of each that did. For clean-up hooks (``on_exception``): one plugin's failure must not skip the
        others' clean-up."""
        failures = []
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            try:
                _call_one(impl, hook_name, kwargs)
            except Exception as e:  # noqa: BLE001 - reported by the caller
                failures.append((impl.plugin_name, e))
        return failures


def _caller(pm: pluggy.PluginManager, hook_name: str) -> Callable[..., Any]:
    hook = getattr(pm.hook, hook_name)

    def through_pluggy(kwargs: dict):
        try:
            return hook(**kwargs)
        except (PluginError, NonFiniteLossError):  # the latter is the run's state, whoever found it
            raise
        except (Exception, SystemExit) as e:  # KeyboardInterrupt (a signal's stop too) passes unchanged
            raise plugin_error(_raising_plugin(hook, e), hook_name, e) from e

    if not isinstance(pm, ObservedManager):  # no word of its changes: pluggy, always current
        def call(**kwargs):
            return through_pluggy(kwargs)
    else:
        # the manager's generation the caller was chosen at, and the direct caller (None: through pluggy);
        # closure cells, read in one instruction each
        generation: int | None = None
        direct: Callable[[dict], Any] | None = None

        def call(**kwargs):
            nonlocal generation, direct
            if generation != pm.generation:  # (being observed moves the generation too)
                generation, direct = pm.generation, None if pm.observed else _direct_calls(hook_name, hook)
            if direct is not None:
                return direct(kwargs)
            return through_pluggy(kwargs)

    call.__name__ = hook_name
    return call


def _call_one(impl: pluggy.HookImpl, hook_name: str, kwargs: dict):
    return as_plugin(impl.plugin_name, hook_name, impl.function)(*[kwargs[arg] for arg in impl.argnames])


def as_plugin(plugin: str, hook: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, its failures reported as ``plugin``'s in ``hook`` as a hook call reports them
    (``plugin_error``): for work a plugin hands to the loop (the checkpoint plugin's save, ``Run.set_save_due``)."""
    def call(*args):
        try:
            return function(*args)
        except (PluginError, NonFiniteLossError):
            raise
        except (Exception, SystemExit) as e:
            raise plugin_error(plugin, hook, e) from e

    return call


def _direct_calls(hook_name: str, hook) -> Callable[[dict], Any] | None:
    """A function calling the hook's implementations (``get_hookimpls()``, which pluggy calls last to first)
    as pluggy's own call loop does for plain implementations: each with the keyword arguments it names, the
    results that are not ``None`` collected (the first one returned, for a ``firstresult`` hook); a failure
    named by the implementation that raised it. ``None`` when an implementation is a wrapper or takes
    optional arguments: pluggy must call those."""
    impls = hook.get_hookimpls()
    firstresult = bool(hook.spec and hook.spec.opts.get("firstresult"))
    if not impls:
        return _nobody_first if firstresult else _nobody
    if any(i.hookwrapper or i.wrapper or i.kwargnames for i in impls):
        return None
    # each implementation's arguments picked from the keywords by one C call (a comprehension is a call of its own)
    calls = [(impl.plugin_name, impl.function, *_picker(tuple(impl.argnames))) for impl in reversed(impls)]
    if len(calls) == 1:  # one implementation (the checkpoint plugin's on_train_step_end): no loop around it
        return _call_single(hook_name, firstresult, *calls[0])

    def call_all(kwargs: dict):
        results = []
        for plugin, function, pick, single in calls:
            try:
                result = function(pick(kwargs)) if single else function(*pick(kwargs))
            except (PluginError, NonFiniteLossError):
                raise
            except (Exception, SystemExit) as e:  # (a try costs nothing until it catches)
                raise plugin_error(plugin, hook_name, e) from e
            if result is not None:
                if firstresult:
                    return result
                results.append(result)
        return None if firstresult else results

    return call_all


def _call_single(hook_name: str, firstresult: bool, plugin: str, function: Callable, pick: Callable[[dict], Any],
                 single: bool) -> Callable[[dict], Any]:
    """``_direct_calls``' caller of a hook with one plain implementation: the same results and errors."""
    def call_one(kwargs: dict):
        try:
            result = function(pick(kwargs)) if single else function(*pick(kwargs))
        except (PluginError, NonFiniteLossError):
            raise
        except (Exception, SystemExit) as e:
            raise plugin_error(plugin, hook_name, e) from e
        if firstresult:
            return result
        return [] if result is None else [result]

    return call_one


def _nobody(kwargs: dict) -> list:
    return []  # what pluggy returns for a hook without implementations


def _nobody_first(kwargs: dict) -> None:
    return None  # ... and for a firstresult hook without implementations


def _picker(argnames: tuple[str, ...]) -> tuple[Callable[[dict], Any], bool]:
    """``(pick, single)``: ``pick(kwargs)`` is the value of the one name (``single``), else the tuple of
    the values of ``argnames`` in a keyword dict."""
    if not argnames:
        return (lambda kwargs: ()), False
    return operator.itemgetter(*argnames), len(argnames) == 1  # of one key, itemgetter returns its value


def plugin_error(plugin: str, hook: str, error: BaseException) -> PluginError:
    """The ``PluginError`` for ``error`` raised by ``plugin`` in ``hook``. A ``SystemExit`` is not obeyed
    (it would end the process with the plugin's status, 0 included, behind the run's back): the run fails.
    OmegaConf's refusal to change a read-only dict or list of ``run.config`` reads as a dataclass field's."""
    wrapped = PluginError(plugin, hook, read_only_error(error) or error)
    if isinstance(error, SystemExit):
        wrapped.args = (f"plugin '{plugin}' in hook '{hook}' failed: it raised SystemExit({error.code!r}) "
                        "(sys.exit); a plugin may not end the process: raise an exception to stop the run",)
    return wrapped


def _raising_plugin(hook, error: BaseException) -> str:
    """Which implementation of ``hook`` raised ``error``: the one whose code is on the traceback."""
    codes = {getattr(impl.function, "__code__", None): impl.plugin_name for impl in hook.get_hookimpls()}
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return codes[tb.tb_frame.f_code]
        tb = tb.tb_next
    return "unknown"
