"""The plugin manager: entry points, ``plugins.enable``, ``Run(plugins=...)`` and the built-ins its caller
hands it, minus ``plugins.disable``; hooks called through ``Hooks``, whose errors name the failing plugin
and hook. It imports no plugin itself (``csframework.api`` and ``Run`` pass the built-ins)."""
from __future__ import annotations

import difflib
import importlib
from importlib.metadata import distributions
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import pluggy

from . import hookspecs
from .config.readonly import read_only_error
from .errors import ConfigError, NonFiniteLossError, PluginError
from .hookspecs import PROJECT, hookimpl

if TYPE_CHECKING:
    from .backends.base import BackendSpec

__all__ = ["ENTRY_POINT_GROUP", "Hooks", "build_manager", "backend_specs", "hookimpl", "plugin_name"]

ENTRY_POINT_GROUP = "csframework.plugins"


def plugin_name(plugin: Any) -> str:
    """A plugin's name: a module's dotted path, else its ``name`` attribute, else its class name."""
    if isinstance(plugin, ModuleType):
        return plugin.__name__
    name = getattr(plugin, "name", None)
    return name if isinstance(name, str) else type(plugin).__name__


def load_module_path(path: str) -> Any:
    """``pkg.module`` or ``pkg.module:attribute`` (an attribute that is a class is instantiated)."""
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        if attr:
            obj = getattr(obj, attr)
            if isinstance(obj, type):
                obj = obj()
    except Exception as e:  # noqa: BLE001
        error = PluginError(path, None, e)
        error.exit_code = 2  # a plugin that cannot be loaded is a bad config: the run never started
        raise error from e
    return obj


def _entry_point_names() -> list[str]:
    """Installed plugins' names, in the order pluggy's ``load_setuptools_entrypoints`` visits them."""
    return [ep.name for dist in distributions() for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """pluggy's ``load_setuptools_entrypoints``; a plugin that fails to import is named."""
    try:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    except (ConfigError, PluginError):  # refused by Manager.register, naming it
        raise
    except Exception as e:  # noqa: BLE001 - the first entry point not yet loaded (nor blocked) failed
        failed = next((n for n in _entry_point_names() if not pm.has_plugin(n) and not pm.is_blocked(n)), "unknown")
        raise PluginError(failed, None, e) from e


def build_manager(builtins: Iterable[tuple[str, Any]], enable: Iterable[str] = (), extra: Iterable[Any] = (),
                  disable: Iterable[str] = ()) -> pluggy.PluginManager:
    """All plugins: entry points, ``enable`` (module paths), ``extra`` (objects), then ``builtins``
    (``(name, plugin)`` pairs), minus the names in ``disable`` (blocked: never imported or registered).

    pluggy calls the last registered first, so built-ins run before user plugins in each hook.
    """
    builtins, disable = list(builtins), list(disable)
    pm = Manager(PROJECT)
    pm.add_hookspecs(hookspecs)
    known = _entry_point_names() + list(enable) + [plugin_name(p) for p in extra] + [n for n, _ in builtins]
    unknown = set(disable) - set(known)
    if unknown:
        raise ConfigError(f"plugins.disable: no plugin named {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(set(known)))})")
    for name in disable:
        pm.set_blocked(name)
    _load_entry_points(pm)
    candidates = [(path, load_module_path(path)) for path in enable if not pm.is_blocked(path)]
    candidates += [(plugin_name(p), p) for p in extra] + builtins
    for name, plugin in candidates:
        if pm.is_blocked(name):
            continue
        if pm.has_plugin(name):
            raise ConfigError(f"plugins: two plugins are named '{name}'; give one a different `name`")
        pm.register(plugin, name=name)
    return pm


def backend_specs(hooks: Hooks) -> dict[str, BackendSpec]:
    """The backend of every device type the plugins supply (``csframework_backend``), by device type."""
    types = dict.fromkeys(t for found in hooks.csframework_device_types() for t in found or ())
    specs = {t: hooks.csframework_backend(device_type=t) for t in sorted(types)}
    return {t: spec for t, spec in specs.items() if spec is not None}


class Manager(pluggy.PluginManager):
    """pluggy's manager, whose ``register`` (entry points' included) first checks each of a plugin's hook
    implementations against the hook specs (``check_hookimpls``)."""

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        name = name or plugin_name(plugin)
        check_hookimpls(self, name, plugin)
        try:
            return super().register(plugin, name=name)
        except Exception as e:  # noqa: BLE001 - pluggy's other refusals (e.g. a wrapper that is no generator)
            raise PluginError(name, None, e) from e


def check_hookimpls(pm: pluggy.PluginManager, name: str, plugin: Any) -> None:
    """Check each of ``plugin``'s hook implementations against the hook specs.

    pluggy would accept an implementation of a hook that does not exist (``check_pending`` finds it later,
    naming the plugin's repr) and refuses one with an unknown argument in a multi-line message; here both
    are a ``ConfigError`` (exit status 2, nothing built) naming the plugin and the hook, with the hook
    that was probably meant or the arguments the hook has. ``optionalhook=True`` implementations of
    unknown hooks stay allowed, as in pluggy.
    """
    for attr in dir(plugin):
        opts = pm.parse_hookimpl_opts(plugin, attr)
        if opts is None:
            continue
        hook_name = opts.get("specname") or attr
        caller = getattr(pm.hook, hook_name, None)
        if caller is None or not caller.has_spec():
            if opts.get("optionalhook"):
                continue
            close = difflib.get_close_matches(hook_name, _hook_names(pm), n=1)
            hint = f"did you mean '{close[0]}'?" if close else "see csframework/hookspecs.py for the hooks"
            raise ConfigError(f"plugin '{name}': '{hook_name}' is not a csframework hook ({hint}); rename it, "
                              "or mark it @csframework.hookimpl(optionalhook=True) if it is meant for a "
                              "hook that may not exist")
        impl = pluggy.HookImpl(plugin, name, getattr(plugin, attr), opts)
        allowed = caller.spec.argnames + caller.spec.kwargnames
        unknown = [arg for arg in impl.argnames if arg not in allowed]
        if unknown:
            raise ConfigError(f"plugin '{name}': hook '{hook_name}' has no argument "
                              f"{', '.join(repr(a) for a in unknown)} (its arguments: {', '.join(allowed)}); "
                              "take any subset of them, by name")


def _hook_names(pm: pluggy.PluginManager) -> list[str]:
    return [n for n in vars(pm.hook) if not n.startswith("_") and getattr(pm.hook, n).has_spec()]


class Hooks:
    """Calls hooks by attribute (``hooks.on_fit_start(run=run)``); an exception raised inside an
    implementation becomes a ``PluginError`` naming the plugin and the hook.

    The plugins are fixed when a run is built, so a hook nobody implements becomes a no-op here: the
    per-step hooks then cost a function call, not a pluggy dispatch.
    """

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        for name in dir(pm.hook):
            if not name.startswith("_"):
                setattr(self, name, self._caller(name, getattr(pm.hook, name)))

    @staticmethod
    def _caller(hook_name: str, hook):
        if not hook.get_hookimpls():
            firstresult = bool(hook.spec and hook.spec.opts.get("firstresult"))

            def nobody(**kwargs):
                return None if firstresult else []  # what pluggy returns for a hook without implementations

            nobody.__name__ = hook_name
            return nobody

        def call(**kwargs):
            try:
                return hook(**kwargs)
            except (PluginError, NonFiniteLossError):  # the latter is the run's state, whoever found it
                raise
            except (Exception, SystemExit) as e:  # KeyboardInterrupt (a signal's stop too) passes unchanged
                raise plugin_error(_raising_plugin(hook, e), hook_name, e) from e

        call.__name__ = hook_name
        return call

    def each(self, hook_name: str, **kwargs) -> Iterator[tuple[str, Any]]:
        """Call the implementations of ``hook_name`` one at a time, in pluggy's order, yielding
        ``(plugin name, result)`` after each: for results and side effects a caller must attribute to
        the plugin that made them. Errors are wrapped as in a normal call."""
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            yield impl.plugin_name, self._call_one(impl, hook_name, kwargs)

    def each_isolated(self, hook_name: str, **kwargs) -> list[tuple[str, Exception]]:
        """Call every implementation of ``hook_name`` even when some raise; returns ``(plugin name, error)``
        of each that did. For clean-up hooks (``on_exception``): one plugin's failure must not skip the
        others' clean-up."""
        failures = []
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            try:
                self._call_one(impl, hook_name, kwargs)
            except Exception as e:  # noqa: BLE001 - reported by the caller
                failures.append((impl.plugin_name, e))
        return failures

    @staticmethod
    def _call_one(impl, hook_name: str, kwargs: dict):
        try:
            return impl.function(*[kwargs[arg] for arg in impl.argnames])
        except (PluginError, NonFiniteLossError):
            raise
        except (Exception, SystemExit) as e:
            raise plugin_error(impl.plugin_name, hook_name, e) from e


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
