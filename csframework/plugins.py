"""The plugin manager: built-ins, entry points, ``plugins.enable`` and ``Run(plugins=...)``, with errors
that name the failing plugin and hook."""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Iterable, Iterator, Sequence

import pluggy

from . import hookspecs
from .config.readonly import read_only_error
from .errors import ConfigError, NonFiniteLossError, PluginError

PROJECT = "csframework"
ENTRY_POINT_GROUP = "csframework.plugins"
#: ``0``/``none``: load no entry-point plugin; ``a,b``: only those; unset, ``1`` or ``all``: every one
#: (like ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``; keeps a test suite independent of what else is installed).
AUTOLOAD_ENV = "CSFRAMEWORK_PLUGINS_AUTOLOAD"
#: Hooks asked before composition, of entry points and ``plugins.enable`` modules.
PRECOMPOSE_HOOKS = ("csframework_register_configs", "csframework_config_sections")
hookimpl = pluggy.HookimplMarker(PROJECT)

_configs_registered: set[str] = set()


class PluginImportError(PluginError):
    """A plugin that could not be imported (or instantiated); says where it came from and how to turn it off."""

    def __init__(self, plugin: str, source: str, error: BaseException, fix: str):
        super().__init__(plugin, None, error)
        self.args = (f"plugin '{plugin}' ({source}) failed to load: {type(error).__name__}: {error}; {fix}",)


def plugin_name(plugin: Any) -> str:
    """A plugin's name: its ``name`` attribute, else a module's dotted path, else its class name (of a
    class or an instance). An entry point's name overrides all of these."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str):
        return name
    if isinstance(plugin, ModuleType):
        return plugin.__name__
    return plugin.__name__ if isinstance(plugin, type) else type(plugin).__name__


def instantiate(name: str, plugin: Any) -> Any:
    """A class plugin becomes an instance (no arguments); modules and instances are used as they are."""
    if not isinstance(plugin, type):
        return plugin
    try:
        return plugin()
    except Exception as e:  # noqa: BLE001 - named like an import failure
        raise PluginImportError(name, f"class {plugin.__module__}.{plugin.__qualname__}", e,
                                f"make it instantiable with no arguments, or turn it off with "
                                f"plugins.disable=[{name}]") from e


def _autoload() -> set[str] | None:
    """The entry-point names ``CSFRAMEWORK_PLUGINS_AUTOLOAD`` allows (``None``: all)."""
    value = os.environ.get(AUTOLOAD_ENV, "").strip()
    if value.lower() in ("", "1", "all"):
        return None
    if value.lower() in ("0", "none"):
        return set()
    return {n.strip() for n in value.split(",") if n.strip()}


def installed_entry_points() -> list:
    """The entry points of group ``csframework.plugins`` that ``CSFRAMEWORK_PLUGINS_AUTOLOAD`` allows,
    by name; nothing is imported."""
    allowed = _autoload()
    return sorted((ep for ep in entry_points(group=ENTRY_POINT_GROUP) if allowed is None or ep.name in allowed),
                  key=lambda e: e.name)


def load_entry_points(disabled: Iterable[str] = ()) -> list[tuple[str, Any]]:
    """Plugins of installed distributions (group ``csframework.plugins``) except ``disabled``, which are
    never imported; the entry-point name is the plugin name."""
    disabled = set(disabled)
    found = []
    for ep in installed_entry_points():
        if ep.name in disabled:
            continue
        try:
            found.append((ep.name, ep.load()))
        except Exception as e:  # noqa: BLE001 - any import failure is reported with the plugin's name
            dist = getattr(ep, "dist", None)
            source = f"distribution {dist.name} {dist.version}" if dist is not None else f"entry point {ep.value}"
            raise PluginImportError(ep.name, source, e, f"turn it off with plugins.disable=[{ep.name}]") from e
    return found


def load_module_path(path: str) -> Any:
    """``pkg.module`` or ``pkg.module:attribute`` (a module, an instance or a class)."""
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        return getattr(obj, attr) if attr else obj
    except Exception as e:  # noqa: BLE001
        raise PluginImportError(path, "plugins.enable", e, "fix it or remove it from plugins.enable") from e


def enabled_plugins(paths: Iterable[str], disabled: Iterable[str] = ()) -> list[tuple[str, Any]]:
    """The plugins of ``plugins.enable``, named; a path that is itself disabled is not imported."""
    disabled = set(disabled)
    found = [(path, load_module_path(path)) for path in paths if path not in disabled]
    return [(plugin_name(obj), obj) for _, obj in found]


def plugin_choices(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``plugins.enable`` and ``plugins.disable`` as the overrides set them (sweeps and unparsable
    overrides are left to Hydra)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    chosen: dict[str, list[str]] = {"plugins.enable": [], "plugins.disable": []}
    wanted = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in chosen]
    try:
        parsed = OverridesParser.create().parse_overrides(wanted)
    except Exception:  # noqa: BLE001 - Hydra reports it when it composes
        return [], []
    for override in parsed:
        if override.is_sweep_override() or override.is_delete():
            continue
        value = override.value()
        chosen[override.key_or_group] = [str(v) for v in (value if isinstance(value, list) else [value])]
    return chosen["plugins.enable"], chosen["plugins.disable"]


def precompose(enable: Iterable[str] = (), disable: Iterable[str] = ()) -> dict[str, type]:
    """What plugins contribute before composition: let installed entry points and ``plugins.enable``
    modules (minus ``disable``) register configs (once per process), and collect their config sections.

    Returns ``{section: dataclass}``. A section that is a built-in key, or that two plugins declare, or
    that is not a dataclass is a ``ConfigError`` naming the plugin(s) and the key.
    """
    from hydra.core.config_store import ConfigStore

    from .config import RunConfig

    pm = new_manager()
    for name, plugin in load_entry_points(disable) + enabled_plugins(enable, disable):
        if name in disable or pm.has_plugin(name):
            continue
        if isinstance(plugin, type) and not any(hasattr(plugin, h) for h in PRECOMPOSE_HOOKS):
            continue  # a class is instantiated before composition only if it has something to say then
        register(pm, name, instantiate(name, plugin))
    fresh = [impl for impl in pm.hook.csframework_register_configs.get_hookimpls()
             if impl.plugin_name not in _configs_registered]
    for impl in fresh:
        _call(impl, "csframework_register_configs", config_store=ConfigStore.instance())
        _configs_registered.add(impl.plugin_name)

    builtin = {f.name for f in dataclasses.fields(RunConfig)}
    sections: dict[str, type] = {}
    owners: dict[str, str] = {}
    for impl in pm.hook.csframework_config_sections.get_hookimpls():  # in registration order
        plugin = impl.plugin_name
        declared = _call(impl, "csframework_config_sections") or {}
        if not isinstance(declared, dict):
            raise ConfigError(f"plugin '{plugin}': csframework_config_sections must return a dict "
                              f"{{section: dataclass}}, got {type(declared).__name__}")
        for section, schema in declared.items():
            if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
                raise ConfigError(f"{section}: plugin '{plugin}' declares it as {schema!r}; a config section "
                                  "must be a dataclass type")
            if section in builtin:
                raise ConfigError(f"{section}: plugin '{plugin}' declares config section '{section}', which is "
                                  "a built-in key; the plugin must name its section differently")
            if section in owners:
                raise ConfigError(f"{section}: plugins '{owners[section]}' and '{plugin}' both declare config "
                                  f"section '{section}'; turn one off with plugins.disable=[{plugin}]")
            sections[section], owners[section] = schema, plugin
    return sections


def _call(impl, hook_name: str, **kwargs):
    """Call one hook implementation directly, naming its plugin if it raises."""
    try:
        return impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
    except Exception as e:  # noqa: BLE001
        raise PluginError(impl.plugin_name, hook_name, e) from e


def new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def build_manager(config, extra: Iterable[Any] = ()) -> pluggy.PluginManager:
    """All plugins of a run, minus ``plugins.disable`` (blocked before they are imported or instantiated).

    Registration order: user plugins (entry points, ``plugins.enable``, ``extra``), then the built-ins.
    pluggy calls the last registered first, so built-ins run before user plugins in each hook. A class is
    instantiated here, once per run, so no two runs (jobs of a sweep) share a plugin's state.
    """
    from .builtin import builtin_plugins

    disabled = set(config.plugins.disable)
    candidates = load_entry_points(disabled) + enabled_plugins(config.plugins.enable, disabled)
    candidates += [(plugin_name(p), p) for p in extra]
    candidates += builtin_plugins()
    known = {name for name, _ in candidates} | {ep.name for ep in installed_entry_points()}
    known |= set(config.plugins.enable)
    unknown = disabled - known
    if unknown:
        raise ConfigError(f"plugins.disable: no plugin named {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(known))})")
    pm = new_manager()
    for name in disabled:
        pm.set_blocked(name)
    for name, plugin in candidates:
        if pm.is_blocked(name):
            continue
        if pm.has_plugin(name):
            raise ConfigError(f"plugins: two plugins are named '{name}'; give one a different `name`")
        register(pm, name, instantiate(name, plugin))
    _check_sections(pm, config)
    return pm


def _check_sections(pm: pluggy.PluginManager, config) -> None:
    """A plugin that declares a section the composed config lacks was not known before composition."""
    have = {f.name for f in dataclasses.fields(config)}
    for impl in pm.hook.csframework_config_sections.get_hookimpls():
        missing = sorted(set(_call(impl, "csframework_config_sections") or {}) - have)
        if missing:
            raise ConfigError(f"{missing[0]}: plugin '{impl.plugin_name}' declares config section "
                              f"'{missing[0]}', but the config was composed without it; a plugin with a config "
                              "section must be installed (entry point) or given in plugins.enable, not only "
                              "to Run(plugins=[...])")


def register(pm: pluggy.PluginManager, name: str, plugin: Any) -> None:
    """Register ``plugin`` after checking each of its hook implementations against the hook specs.

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
    try:
        pm.register(plugin, name=name)
    except Exception as e:  # noqa: BLE001 - pluggy's other refusals (e.g. a wrapper that is no generator)
        raise PluginError(name, None, e) from e


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
            def nobody(**kwargs):
                return []  # what pluggy returns for a hook without implementations

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
