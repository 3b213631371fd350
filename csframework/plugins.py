"""The plugin manager: entry points, ``plugins.enable``, ``Run(plugins=...)`` and the built-ins its caller
hands it, minus ``plugins.disable``; hooks called through ``Hooks``, whose errors name the failing plugin
and hook. It imports no plugin itself (``csframework.api`` and ``Run`` pass the built-ins)."""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import keyword
import os
import re
from importlib.metadata import entry_points
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import pluggy

from . import hookspecs, hooks
from .errors import ConfigError, ExitCode, PluginError, PluginImportError
from .hooks import Hooks
from .hookspecs import PROJECT, hookimpl

if TYPE_CHECKING:
    from .config import RunConfig
    from .protocol import BackendSpec

__all__ = ["ENTRY_POINT_GROUP", "AUTOLOAD_ENV", "COMPOSITION_HOOKS", "SECTION_NAME", "RESERVED_SECTIONS", "Hooks",
           "build_manager", "backend_specs", "named_backend_specs", "config_sections", "check_sections",
           "plugin_choices", "hookimpl", "plugin_name", "validation_problems"]

ENTRY_POINT_GROUP = "csframework.plugins"
#: ``0``/``none``: load no entry-point plugin; ``a,b``: only those; unset, ``1`` or ``all``: every one
#: (like ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``; keeps a test suite independent of what else is installed).
AUTOLOAD_ENV = "CSFRAMEWORK_PLUGINS_AUTOLOAD"
#: The hooks asked before composition; a class plugin is instantiated then only if it implements one.
COMPOSITION_HOOKS = ("csframework_register_configs", "csframework_config_sections", "csframework_device_types",
                     "csframework_backend", "csframework_named_backends")
#: A plugin's config section is a top-level key: set from the command line (Hydra's grammar takes ASCII
#: letters, digits and ``_``) and read as an attribute of ``run.config``. Names with a leading underscore
#: are Hydra's and OmegaConf's (``_target_``, ``_self_`` ...); ``hydra`` and ``defaults`` are Hydra's keys.
SECTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
RESERVED_SECTIONS = frozenset({"hydra", "defaults"})


def plugin_name(plugin: Any) -> str:
    """A plugin's name: its ``name`` attribute, else a module's dotted path, else its class name (of a
    class or an instance). An entry point's name overrides all of these."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str):
        return name
    if isinstance(plugin, ModuleType):
        return plugin.__name__
    return plugin.__name__ if isinstance(plugin, type) else type(plugin).__name__


def instantiate(name: str, plugin: Any, configured: bool = False) -> Any:
    """A class plugin becomes an instance (no arguments); modules and instances are used as they are.
    ``configured``: ``plugins.enable`` names it, so a class that cannot be made is a bad config (exit 2)."""
    if not isinstance(plugin, type):
        return plugin
    try:
        return plugin()
    except Exception as e:  # noqa: BLE001 - named like an import failure
        off = "remove it from plugins.enable" if configured else f"turn it off with plugins.disable=[{name}]"
        raise PluginImportError(name, f"class {plugin.__module__}.{plugin.__qualname__}", e,
                                f"make it instantiable with no arguments, or {off}",
                                exit_code=ExitCode.CONFIG_ERROR if configured else None) from e


def check_implements_hooks(pm: pluggy.PluginManager, path: str, plugin: Any) -> None:
    """``plugins.enable`` names ``path``: a ``ConfigError`` when it implements no hook (a module whose hooks are
    methods of a class in it, hook methods without ``@csframework.hookimpl``), which would do nothing."""
    if pm.get_hookcallers(plugin):
        return
    where = vars(plugin) if isinstance(plugin, ModuleType) else {n: getattr(type(plugin), n) for n in dir(type(plugin))}
    marked = f"{PROJECT}_impl"  # the attribute csframework.hookimpl sets
    unmarked = sorted(n for n, v in where.items() if callable(v) and not n.startswith("_") and hasattr(pm.hook, n)
                      and not hasattr(v, marked))
    classes = sorted(n for n, v in where.items() if isinstance(plugin, ModuleType) and isinstance(v, type)
                     and v.__module__ == plugin.__name__ and any(hasattr(getattr(v, a, None), marked) for a in dir(v)))
    fix = (f"name the class that does: {', '.join(f'{path}:{c}' for c in classes)}" if classes else
           f"mark {', '.join(unmarked)} with @csframework.hookimpl" if unmarked else
           "implement a hook (csframework.hookspecs lists them) with @csframework.hookimpl")
    raise ConfigError(f"plugins.enable: {path} implements no hook, so it would do nothing; {fix}")


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
    if allowed is not None and not allowed:  # autoload off: no need to read every distribution's metadata
        return []
    return sorted((ep for ep in entry_points(group=ENTRY_POINT_GROUP) if allowed is None or ep.name in allowed),
                  key=lambda e: e.name)


def load_entry_points(disabled: Iterable[str] = (), installed: list | None = None) -> list[tuple[str, Any]]:
    """Plugins of installed distributions except ``disabled``, which are never imported; the entry-point
    name is the plugin name. One that fails to import is named with its distribution. ``installed``: the
    result of ``installed_entry_points()`` when the caller has it already."""
    disabled = set(disabled)
    found = []
    for ep in installed_entry_points() if installed is None else installed:
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
        # a plugin the config names that cannot be loaded is a bad config: nothing ran
        raise PluginImportError(path, "plugins.enable", e, "fix it or remove it from plugins.enable",
                                exit_code=ExitCode.CONFIG_ERROR) from e


def plugin_choices(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``plugins.enable`` and ``plugins.disable`` as command-line overrides set them (sweeps and unparsable
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


def build_manager(builtins: Iterable[tuple[str, Any]], enable: Iterable[str] = (), extra: Iterable[Any] = (),
                  disable: Iterable[str] = (), asking: Sequence[str] | None = None) -> pluggy.PluginManager:
    """All plugins: entry points, ``enable`` (module paths), ``extra`` (objects or module paths), then ``builtins``
    (``(name, plugin)`` pairs; a plugin given as ``"pkg.module:attribute"`` is imported only when it is
    registered), minus the names in ``disable`` (blocked: never imported or registered).

    pluggy calls the last registered first, so built-ins run before user plugins in each hook. A class is
    instantiated here (no arguments), so each run has its own instance; with ``asking`` (hook names, before
    composition) only a class that implements one of them is.
    """
    disable = set(disable)
    installed = installed_entry_points()  # read once: scanning the distributions' metadata is not free
    candidates = load_entry_points(disable, installed)
    configured = {path: load_module_path(path) for path in enable if path not in disable}
    candidates += [(plugin_name(obj), obj) for obj in configured.values()]
    # a string among ``extra`` (``csf.compose(plugins=["pkg.module"])``) is a module path, as in ``enable``
    extra = [load_module_path(p) if isinstance(p, str) else p for p in extra]
    candidates += [(plugin_name(p), p) for p in extra] + list(builtins)
    known = {n for n, _ in candidates} | {ep.name for ep in installed} | set(enable)
    unknown = disable - known
    if unknown:
        raise ConfigError(f"plugins.disable: no plugin named {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(known))})")
    pm = CheckingManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in disable:
        pm.set_blocked(name)
    for name, plugin in candidates:
        if pm.is_blocked(name):
            continue
        if isinstance(plugin, str):  # a built-in named by its path: imported now that it is not disabled
            module_name, _, attr = plugin.partition(":")
            plugin = getattr(importlib.import_module(module_name), attr)
        if asking is not None and isinstance(plugin, type) and not any(hasattr(plugin, h) for h in asking):
            continue
        if pm.is_registered(plugin):  # one module both installed (entry point) and named again: once
            continue
        if pm.has_plugin(name):
            raise ConfigError(f"plugins: two plugins are named '{name}'; give one a different `name`")
        path = next((p for p, obj in configured.items() if obj is plugin), None)
        registered = instantiate(name, plugin, configured=path is not None)
        pm.register(registered, name=name)
        if path is not None:
            check_implements_hooks(pm, path, registered)
    return pm


def _declared(impl) -> dict:
    """What one implementation of ``csframework_config_sections`` declares (its plugin named if it raises)."""
    try:
        declared = impl.function() or {}
    except Exception as e:  # noqa: BLE001
        raise PluginError(impl.plugin_name, "csframework_config_sections", e) from e
    if not isinstance(declared, dict):
        raise ConfigError(f"plugin '{impl.plugin_name}': csframework_config_sections must return a dict "
                          f"{{section: dataclass}}, got {type(declared).__name__}")
    return declared


def config_sections(pm: pluggy.PluginManager) -> dict[str, type]:
    """The plugins' config sections (``csframework_config_sections``), ``{section: dataclass}``. A section
    whose name is no valid section name (``SECTION_NAME``, ``RESERVED_SECTIONS``), that is a built-in key,
    or that two plugins declare, or that is not a dataclass whose defaults its types can hold, is a
    ``ConfigError`` naming the plugin(s) and the section."""
    from .config import RunConfig

    builtin = {f.name for f in dataclasses.fields(RunConfig)}
    sections: dict[str, type] = {}
    owners: dict[str, str] = {}
    for impl in pm.hook.csframework_config_sections.get_hookimpls():  # in registration order
        plugin = impl.plugin_name
        for section, schema in _declared(impl).items():
            if section in builtin:
                raise ConfigError(f"{section}: plugin '{plugin}' declares config section '{section}', which is "
                                  "a built-in key; the plugin must name its section differently")
            bad_name = _name_problem(section, RunConfig)
            if bad_name:
                raise ConfigError(f"plugin '{plugin}' declares config section {section!r}, which {bad_name}; "
                                  "the plugin must name its section differently")
            if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
                raise ConfigError(f"{section}: plugin '{plugin}' declares it as {schema!r}; a config section "
                                  "must be a dataclass type")
            bad_schema = _schema_problem(schema)
            if bad_schema:
                raise ConfigError(f"{section}: plugin '{plugin}' declares config section '{section}' as "
                                  f"{schema.__qualname__}, {bad_schema}")
            if section in owners:
                raise ConfigError(f"{section}: plugins '{owners[section]}' and '{plugin}' both declare config "
                                  f"section '{section}'; turn one off with plugins.disable=[{plugin}]")
            sections[section], owners[section] = schema, plugin
    return sections


def _name_problem(section: Any, root: type) -> str | None:
    """Why ``section`` cannot name a plugin's config section of ``root`` (the run config), or ``None``."""
    if not isinstance(section, str):
        return f"is a {type(section).__name__}, not a string"
    if not SECTION_NAME.fullmatch(section):
        return ("is no valid section name (an ASCII letter, then letters, digits or underscores: a top-level "
                "key the command line can set; a leading underscore is Hydra's, as in _target_)")
    if keyword.iskeyword(section):
        return "is a Python keyword (run.config.<section> could not be written)"
    if section in RESERVED_SECTIONS:
        return "is one of Hydra's own top-level keys"
    if hasattr(root, section):
        return "is an attribute of the run config"
    return None


_valid_schemas: set[type] = set()  # checked once per process: composition asks for the sections repeatedly


def _schema_problem(schema: type) -> str | None:
    """Why ``schema`` cannot be a config section, or ``None``: a frozen or slots dataclass (the run's
    read-only subclass of it cannot be made, or not frozen), a default its declared type cannot hold."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if schema in _valid_schemas:
        return None
    if schema.__dataclass_params__.frozen or "__slots__" in vars(schema):  # type: ignore[attr-defined]
        return ("a frozen or slots dataclass; declare a plain @dataclass (csframework makes every section "
                "read-only while a run runs)")
    try:
        OmegaConf.structured(schema)
    except OmegaConfBaseException as e:
        owner = getattr(e, "object_type", None)
        where = f"field '{e.full_key}'" + (f" of {owner.__qualname__}" if isinstance(owner, type) and owner is not
                                            schema else "")
        what = str(getattr(e, "msg", e)).strip().splitlines()[0]
        return f"whose {where} has a default its declared type cannot hold ({what}); fix the default or the type"
    except Exception as e:  # noqa: BLE001 - e.g. a default_factory that raises
        return f"whose defaults cannot be built ({type(e).__name__}: {e}); fix the dataclass"
    _valid_schemas.add(schema)
    return None


def check_sections(pm: pluggy.PluginManager, config) -> None:
    """A plugin that declares a section the composed config lacks was not known before composition."""
    have = {f.name for f in dataclasses.fields(config)}
    for impl in pm.hook.csframework_config_sections.get_hookimpls():
        missing = sorted(set(_declared(impl)) - have)
        if missing:
            raise ConfigError(f"{missing[0]}: plugin '{impl.plugin_name}' declares config section "
                              f"'{missing[0]}', but the config was composed without it; a plugin with a config "
                              "section must be installed (entry point) or given in plugins.enable, not only "
                              "to Run(plugins=[...])")


def backend_specs(hooks: Hooks) -> dict[str, BackendSpec]:
    """The backend of every device type the plugins supply (``csframework_backend``), by device type."""
    types = dict.fromkeys(t for found in hooks.csframework_device_types() for t in found or ())
    specs = {t: hooks.csframework_backend(device_type=t) for t in sorted(types)}
    return {t: spec for t, spec in specs.items() if spec is not None}


def named_backend_specs(hooks: Hooks) -> dict[str, BackendSpec]:
    """The named backends the plugins supply (``csframework_named_backends``), by name."""
    specs: dict[str, BackendSpec] = {}
    for plugin, found in hooks.each("csframework_named_backends"):
        for spec in found or ():
            if not spec.name:
                raise PluginError(plugin, "csframework_named_backends", ValueError(
                    f"its BackendSpec for {spec.device_type} has no name; set BackendSpec(name=...)"))
            if spec.name in specs:
                raise ConfigError(f"backend={spec.name}: two plugins supply a backend of that name; turn one "
                                  f"off with plugins.disable=[{plugin}]")
            specs[spec.name] = spec
    return specs


class CheckingManager(hooks.ObservedManager):
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


def validation_problems(hooks: Hooks, config: RunConfig) -> list[str]:
    """The problems all ``csframework_validate`` implementations found. Each returns ``None`` or a list of
    strings (a string alone is one problem); any other result is refused naming the plugin (``PluginError``:
    a plugin whose verdict cannot be read must not let the run through)."""
    problems: list[str] = []
    for plugin, verdict in hooks.each("csframework_validate", config=config):
        if verdict is None:
            continue
        found = [verdict] if isinstance(verdict, str) else verdict
        wrong: str | None
        if not isinstance(found, (list, tuple)):
            wrong = f"a value of type {type(found).__name__} ({found!r:.60})"
        else:
            wrong = next((f"a list holding a value of type {type(p).__name__} ({p!r:.60})"
                          for p in found if not isinstance(p, str)), None)
        if wrong:
            raise PluginError(plugin, "csframework_validate", TypeError(
                f"it returned {wrong}; return None or a list of strings, one per problem"))
        problems += found
    return problems
