"""The plugin manager: entry points, ``plugins.enable``, ``Run(plugins=...)`` and the built-ins its caller
hands it, minus ``plugins.disable``; hooks called through ``Hooks``, whose errors name the failing plugin
and hook. It imports no plugin itself (``csframework.api`` and ``Run`` pass the built-ins)."""
from __future__ import annotations

import importlib
from importlib.metadata import distributions
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable

import pluggy

from . import hookspecs
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
        raise PluginError(path, None, e) from e
    return obj


def _entry_point_names() -> list[str]:
    """Installed plugins' names, in the order pluggy's ``load_setuptools_entrypoints`` visits them."""
    return [ep.name for dist in distributions() for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """pluggy's ``load_setuptools_entrypoints``; a plugin that fails to import is named."""
    try:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
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
    pm = pluggy.PluginManager(PROJECT)
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
        try:
            pm.register(plugin, name=name)
        except Exception as e:  # noqa: BLE001 - e.g. an implementation of a hook that does not exist
            raise PluginError(name, None, e) from e
    return pm


def backend_specs(hooks: Hooks) -> dict[str, BackendSpec]:
    """The backend of every device type the plugins supply (``csframework_backend``), by device type."""
    types = dict.fromkeys(t for found in hooks.csframework_device_types() for t in found or ())
    specs = {t: hooks.csframework_backend(device_type=t) for t in sorted(types)}
    return {t: spec for t, spec in specs.items() if spec is not None}


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
            except Exception as e:
                raise PluginError(_raising_plugin(hook, e), hook_name, e) from e

        call.__name__ = hook_name
        return call


def _raising_plugin(hook, error: BaseException) -> str:
    """Which implementation of ``hook`` raised ``error``: the one whose code is on the traceback."""
    codes = {getattr(impl.function, "__code__", None): impl.plugin_name for impl in hook.get_hookimpls()}
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return codes[tb.tb_frame.f_code]
        tb = tb.tb_next
    return "unknown"
