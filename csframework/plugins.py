"""The plugin manager: built-ins, entry points, ``plugins.enable`` and ``Run(plugins=...)``, with errors
that name the failing plugin and hook."""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Iterable

import pluggy

from . import hookspecs
from .errors import ConfigError, NonFiniteLossError, PluginError

PROJECT = "csframework"
ENTRY_POINT_GROUP = "csframework.plugins"
hookimpl = pluggy.HookimplMarker(PROJECT)

_configs_registered = False


def plugin_name(plugin: Any) -> str:
    """A plugin's name: a module's dotted path, else its ``name`` attribute, else its class name."""
    if isinstance(plugin, ModuleType):
        return plugin.__name__
    name = getattr(plugin, "name", None)
    return name if isinstance(name, str) else type(plugin).__name__


def load_entry_points() -> list[tuple[str, Any]]:
    """Plugins of installed distributions (group ``csframework.plugins``); the entry-point name is the
    plugin name."""
    found = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            found.append((ep.name, ep.load()))
        except Exception as e:  # noqa: BLE001 - any import failure is reported with the plugin's name
            raise PluginError(ep.name, None, e) from e
    return found


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


def register_configs_from_entry_points() -> None:
    """Let entry-point plugins add configs to Hydra's ConfigStore before composition (once per process)."""
    global _configs_registered
    if _configs_registered:
        return
    from hydra.core.config_store import ConfigStore

    pm = new_manager()
    for name, plugin in load_entry_points():
        pm.register(plugin, name=name)
    Hooks(pm).csframework_register_configs(config_store=ConfigStore.instance())
    _configs_registered = True


def new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def build_manager(config, extra: Iterable[Any] = ()) -> pluggy.PluginManager:
    """All plugins of a run, minus ``plugins.disable``.

    Registration order: user plugins (entry points, ``plugins.enable``, ``extra``), then the built-ins.
    pluggy calls the last registered first, so built-ins run before user plugins in each hook.
    """
    from .builtin import builtin_plugins

    candidates = list(load_entry_points())
    candidates += [(path, load_module_path(path)) for path in config.plugins.enable]
    candidates += [(plugin_name(p), p) for p in extra]
    candidates += builtin_plugins()
    disabled = set(config.plugins.disable)
    unknown = disabled - {name for name, _ in candidates}
    if unknown:
        raise ConfigError(f"plugins.disable: no plugin named {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(n for n, _ in candidates))})")
    pm = new_manager()
    for name, plugin in candidates:
        if name in disabled:
            continue
        if pm.has_plugin(name):
            raise ConfigError(f"plugins: two plugins are named '{name}'; give one a different `name`")
        try:
            pm.register(plugin, name=name)
        except Exception as e:  # noqa: BLE001 - e.g. an implementation of a hook that does not exist
            raise PluginError(name, None, e) from e
    return pm


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
            def nobody(**kwargs):
                return []  # what pluggy returns for a hook without implementations

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
