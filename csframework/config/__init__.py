"""Typed config schemas and composition: overrides -> Hydra -> ``RunConfig``.

Composition knows no plugin: what it needs from them comes in as arguments (``backends``: the ``backend``
schema of each device type; ``config_files``: the config directories of backend plugins; ``sections``: the
plugins' own config sections).
``csframework.api`` asks the plugins for these and passes them in.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError, ValidationError
from .backend import BackendConfig, DeviceConfig
from .optimizer import FIELDS_BY_OPTIMIZER, OptimizerConfig, ScheduleConfig
from .precision import PRECISIONS, PrecisionConfig
from .readonly import ReadOnly
from .run import STAGE_KEYS, Mode, RunConfig
from .sections import CheckpointConfig, DataConfig, LoopConfig, PluginsConfig

__all__ = [
    "RunConfig", "DeviceConfig", "BackendConfig", "OptimizerConfig", "ScheduleConfig", "PrecisionConfig",
    "DataConfig", "LoopConfig", "CheckpointConfig", "PluginsConfig", "Mode", "STAGE_KEYS",
    "FIELDS_BY_OPTIMIZER", "PRECISIONS", "compose", "compose_dict", "register_schemas", "to_run_config",
    "stage_config", "stage_configs", "for_each_stage", "explicit_groups", "describe_error", "register_config_files",
    "user_config_dirs", "check_config_files", "resolve_run_dir", "run_config_type", "plugin_sections",
    "disabled_section", "flat_config",
]

SCHEMA_NAME = "csframework_schema"
#: A user's config file beyond these is refused before Hydra reads it: YAML aliases can expand a small
#: file exponentially (a "billion laughs" alias bomb), which would hang composition.
MAX_CONFIG_BYTES = 4 * 2**20
MAX_CONFIG_NODES = 100_000
#: ... and one nested deeper than this: Hydra reads YAML with PyYAML's recursive pure-Python parser, which
#: would fail with a RecursionError a few hundred levels down (no config nests more than a handful).
MAX_CONFIG_DEPTH = 100


_types: dict[tuple, type] = {}


def run_config_type(sections: Mapping[str, type] | None = None) -> type:
    """``RunConfig`` extended by plugin config sections (``{name: dataclass}``), each a typed top-level
    field holding the dataclass's defaults; one class per set of sections."""
    if not sections:
        return RunConfig
    key = tuple(sorted(sections.items(), key=lambda item: item[0]))
    if key not in _types:
        typed = [(name, _read_only(schema)) for name, schema in key]
        _types[key] = dataclasses.make_dataclass(
            "RunConfig", [(name, schema, dataclasses.field(default_factory=schema)) for name, schema in typed],
            bases=(RunConfig,))
    return _types[key]


def _read_only(schema: type) -> type:
    """A plugin's section dataclass with the ``ReadOnly`` mix-in of the built-in schemas (a subclass: the
    plugin's own ``isinstance`` checks hold), so it is as read-only during a run as they are."""
    if issubclass(schema, ReadOnly):
        return schema
    return dataclasses.make_dataclass(schema.__name__, [], bases=(ReadOnly, schema))


def plugin_sections(config) -> tuple[str, ...]:
    """The config sections plugins added to ``config`` (a stage may set them too)."""
    builtin = {f.name for f in fields(RunConfig)}
    return tuple(f.name for f in fields(config) if f.name not in builtin)


def disabled_section(key: str, disabled: Iterable[str], sections: Mapping[str, type] | None) -> str | None:
    """The error for setting ``key`` when its section is that of a disabled plugin (a section named after
    its plugin, as every first-party one is)."""
    top = key.split(".", 1)[0]
    if top in set(disabled) and top not in (sections or {}):
        return (f"{key}: plugin '{top}' is disabled (plugins.disable), so its config section is gone; "
                f"remove the setting or enable the plugin")
    return None


def _schema(sections: Mapping[str, type] | None = None) -> DictConfig:
    """``RunConfig`` (with the plugins' ``sections``) as Hydra composes it: typed, except the ``backend``
    node, which takes any key until ``to_run_config`` types it with the schema of its device type."""
    schema = OmegaConf.structured(run_config_type(sections))
    with open_dict(schema):
        schema.backend = {"type": "CPU"}
    OmegaConf.set_struct(schema.backend, False)
    # the keyword arguments of a `_target_` optimizer or schedule are open: `optimizer.args.alpha=0.9`
    # adds a key without Hydra's `+` (every other section stays closed, so a typo is an error)
    OmegaConf.set_struct(schema.optimizer.args, False)
    OmegaConf.set_struct(schema.optimizer.schedule.args, False)
    return schema


_schemas: dict[type, DictConfig] = {}


def _cached_schema(sections: Mapping[str, type] | None = None) -> DictConfig:
    """``_schema(sections)``, built once per set of sections (building it costs more than copying it): only
    for callers that copy it and leave it as it was (``OmegaConf.merge``, ``ConfigStore.store``)."""
    kind = run_config_type(sections)
    if kind not in _schemas:
        _schemas[kind] = _schema(sections)
    return _schemas[kind]


def register_schemas(sections: Mapping[str, type] | None = None) -> None:
    """Put the ``RunConfig`` schema (with the plugins' ``sections``) into Hydra's ConfigStore;
    ``conf/config.yaml`` builds on it."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=_cached_schema(sections))  # the store keeps a copy


def flat_config(config) -> dict:
    """A run config as ``{"dotted.key": value}`` (plain values: enums as their value, lists as lists),
    e.g. for loggers that record parameters."""
    flat: dict = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node.value if isinstance(node, enum.Enum) else node

    walk(OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True), "")
    return flat


def explicit_groups(overrides: Iterable[str]) -> list[str]:
    """The device-choosing groups (``device``, ``backend``) selected in ``overrides``."""
    chosen = set()
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in ("device", "backend") and "=" in item:
            chosen.add(key)
    return sorted(chosen)


def user_config_dirs(overrides: Iterable[str], *dirs: str | None) -> list[str]:
    """The user's config directories: ``dirs`` and the ``file://`` entries of a ``hydra.searchpath``
    override (``pkg://`` entries are installed packages, trusted like csframework's own configs)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = [d for d in dirs if d]
    for item in overrides:
        if item.split("=", 1)[0].lstrip("+~") != "hydra.searchpath":
            continue
        try:
            entries = OverridesParser.create().parse_overrides([item])[0].value()
        except Exception:  # noqa: BLE001 - Hydra reports the unparsable override itself
            continue
        entries = entries if isinstance(entries, list) else [entries]
        found += [e[len("file://"):] for e in entries if isinstance(e, str) and e.startswith("file://")]
    return found


def check_config_files(dirs: Iterable[str]) -> None:
    """Raise ``ConfigError`` naming the first YAML file under ``dirs`` larger than ``MAX_CONFIG_BYTES``,
    nested deeper than ``MAX_CONFIG_DEPTH``, or whose aliases expand it beyond ``MAX_CONFIG_NODES`` nodes (or
    without end). The count is taken on the composed node graph, where an alias is one shared node, memoised
    per node: it costs what the file costs to parse, however far it would expand. A file YAML cannot parse
    is left to Hydra to report."""
    import yaml

    seen: set[str] = set()
    for top in dirs:
        for root, subdirs, files in os.walk(top, followlinks=True):
            seen.add(os.path.realpath(root))
            subdirs[:] = [d for d in subdirs if os.path.realpath(os.path.join(root, d)) not in seen]
            for path in (os.path.join(root, f) for f in sorted(files) if f.endswith((".yaml", ".yml"))):
                if os.path.getsize(path) > MAX_CONFIG_BYTES:
                    raise ConfigError(f"{path}: {os.path.getsize(path):,} bytes, larger than a config file "
                                      f"may be ({MAX_CONFIG_BYTES:,}); keep data out of config files")
                sizes: dict[int, int] = {}

                def size(node, depth: int = 0) -> int:
                    if depth > MAX_CONFIG_DEPTH:
                        raise RecursionError
                    if id(node) not in sizes:
                        sizes[id(node)] = MAX_CONFIG_NODES + 1  # met again while counting it: a cycle
                        children = ([part for pair in node.value for part in pair]
                                    if isinstance(node, yaml.MappingNode) else
                                    node.value if isinstance(node, yaml.SequenceNode) else [])
                        sizes[id(node)] = 1 + sum(size(child, depth + 1) for child in children)
                    return sizes[id(node)]

                try:
                    root_node = _compose_yaml(path, yaml)
                    total = size(root_node) if root_node is not None else 0
                except yaml.YAMLError:
                    continue
                except RecursionError:
                    raise ConfigError(f"{path}: nested too deeply to be a config file (more than "
                                      f"{MAX_CONFIG_DEPTH} levels)") from None
                if total > MAX_CONFIG_NODES:
                    raise ConfigError(f"{path}: its YAML aliases expand it to more than {MAX_CONFIG_NODES:,} "
                                      "nodes (an alias bomb?); a config file must stay below that")


def _compose_yaml(path: str, yaml):
    """The node graph of the YAML file at ``path``, by libyaml where PyYAML has it (fast). libyaml refuses
    nesting beyond its own limit as a syntax error; the pure-Python parser, which Hydra uses, then decides:
    a syntax error again (``YAMLError``), or a ``RecursionError``."""
    with open(path, "rb") as f:
        text = f.read()
    try:
        return yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return yaml.compose(text, Loader=yaml.SafeLoader)


def describe_error(error: BaseException, prefix: str = "") -> str:
    """One line for a composition error, naming the full key where OmegaConf knows it (or the override,
    the config group or the file); ``prefix`` is the path of the node the error is relative to
    (``stages.<name>.``). An unknown key gets the nearest known one ("did you mean"); a key of an open
    map that does not exist (``stages.b.loop.max_steps=3`` without a stage ``b``) gets Hydra's ``+`` form."""
    append = re.search(r"To append to your config use (\S+)", str(error))
    seen = error
    while seen is not None:
        found = _describe_known(seen)
        if found:
            return found
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            msg = str(getattr(seen, "msg", None) or seen).splitlines()[0]
            key = prefix + seen.full_key
            if append and getattr(seen, "object_type", None) is dict:
                return f"{key}: not in the config; to add it, write {append.group(1)}"
            hint = next((h for text, h in _INTERPOLATION_HINTS.items() if text in msg), "")
            return f"{key}: {msg}{hint}{_did_you_mean(seen, key)}"
        seen = seen.__cause__ or seen.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return prefix + (" ".join(lines[:3]) if lines else type(error).__name__)


def _did_you_mean(error: OmegaConfBaseException, key: str) -> str:
    """``; did you mean `loop.max_steps`?`` for an unknown key of a schema, when one is close enough."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    schema = getattr(error, "object_type", None)
    name = getattr(error, "key", None)
    if not (isinstance(error, (ConfigAttributeError, ConfigKeyError)) and dataclasses.is_dataclass(schema)
            and isinstance(name, str) and key.endswith(name)):
        return ""
    close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(schema) if f.name != name], n=1)
    return f"; did you mean `{key[:len(key) - len(name)]}{close[0]}`?" if close else ""


#: What to do about OmegaConf's interpolation errors, found by their message.
_INTERPOLATION_HINTS = {
    "Recursive interpolation": "; the interpolations refer to each other in a cycle: give one of them a value",
    "Environment variable": "; set it, or give a default: ${oc.env:NAME,default}",
    "Unsupported interpolation type": ": no resolver of that name is registered; check its spelling "
                                      "(e.g. ${oc.env:NAME})",
}


def _describe_known(error: BaseException) -> str | None:
    """Hydra's and YAML's errors that carry the override, group or file in attributes."""
    import yaml
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(error, OverrideParseException):
        return f"{error.override}: cannot parse this override: {str(error.message).splitlines()[0]}"
    if isinstance(error, MissingConfigException):
        missing = error.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if group and error.options is not None:
            close = difflib.get_close_matches(option, error.options, n=1)
            hint = f"; did you mean `{group.replace('/', '.')}={close[0]}`?" if close else ""
            return (f"{group.replace('/', '.')}: no option '{option}' in config group '{group}' "
                    f"(available: {', '.join(error.options) or 'none'}){hint}")
        first = str(error).splitlines()[0].strip()
        return f"{missing or 'config'}: {first}" if missing and missing not in first else first
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return (f"{mark.name}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: "
                f"{error.problem or error.context}")
    if isinstance(error, yaml.YAMLError):
        return f"invalid YAML: {str(error).splitlines()[0]}"
    return None


def to_run_config(cfg: DictConfig, selected: Sequence[str] = (), *, backends: Mapping[str, type],
                  sections: Mapping[str, type] | None = None) -> RunConfig:
    """Turn a composed ``DictConfig`` into the typed ``RunConfig`` (interpolations resolved), with the
    plugins' config ``sections`` as typed top-level fields.

    ``backends`` maps each device type to its ``backend`` schema: ``backend`` becomes an instance of the
    schema of ``backend.type``, so an unknown key or a wrong type names ``backend.<key>``, and a setting
    only another device type's backend has is refused naming that type. When only the ``backend`` group was
    chosen, the device type follows it (``backend=csx`` alone means a CSX run); choosing both groups is left
    for the validation plugin to refuse.
    """
    try:
        # a copy of the node without ``hydra`` (copying Hydra's own config would cost more than the rest)
        cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
        OmegaConf.set_struct(cfg, False)
        if "backend" in selected and "device" not in selected:
            cfg.device.type = cfg.backend.type
        # merged as a plain container, so a key the schema lacks (``+foo=1``) is refused naming it
        typed = OmegaConf.merge(_cached_schema(sections), OmegaConf.to_container(cfg, resolve=False))
        _device_types_upper(typed)
        run = OmegaConf.to_object(typed)  # resolves, naming the key of a failing interpolation
    except OmegaConfBaseException as e:
        disabled = OmegaConf.select(cfg, "plugins.disable", default=None) or []
        problem = disabled_section(getattr(e, "full_key", None) or "", disabled, sections)
        raise ConfigError(problem or describe_error(e)) from e
    run.backend = _typed_backend(run.backend, run.device.type, backends)
    run.selected = tuple(selected)
    return run


def _device_types_upper(cfg: DictConfig) -> None:
    """``device.type`` and ``backend.type`` are case-insensitive (``cpu`` is ``CPU``), as ``device=cpu`` is."""
    for section in ("device", "backend"):
        node = cfg.get(section)
        if isinstance(node, DictConfig) and isinstance(node.get("type"), str):
            node.type = node.type.upper()


def _typed_backend(values: dict, device_type: str, backends: Mapping[str, type]):
    """``values`` (the ``backend`` node) as an instance of its type's schema."""
    known = ", ".join(f"device={t.lower()}" for t in backends)
    problems = []
    if device_type not in backends:
        problems.append(f"device.type: '{device_type}' is not a device type; use {known}")
    kind = values.get("type", device_type)
    schema = backends.get(kind)
    if schema is None:
        problems.append(f"backend.type: '{kind}' is not a device type; use {', '.join(backends)}")
        raise ValidationError(problems)
    own = {f.name for f in fields(schema)}
    for key in sorted(set(values) - own):
        owners = [t for t, other in backends.items() if key in {f.name for f in fields(other)}]
        instead = getattr(schema, "INSTEAD", {}).get(key)  # the schema's own way to the same end
        if owners and instead:
            problems.append(f"backend.{key}: only {'/'.join(owners)} understands it, and this run's device is "
                            f"{kind}; {instead}")
        elif owners:
            problems.append(f"backend.{key}: only {'/'.join(owners)} understands it, and this run's device is "
                            f"{kind}; remove it or use device={owners[0].lower()}")
        else:
            problems.append(f"backend.{key}: the {kind} backend has no such setting (its settings: "
                            f"{', '.join(sorted(own - {'type'}))})")
    if problems:
        raise ValidationError(problems)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as e:
        raise ConfigError(f"backend.{describe_error(e)}") from e


def stage_config(base: RunConfig, name: str, partial) -> RunConfig:
    """The config of stage ``name``: ``base`` merged with the stage's partial config."""
    partial = OmegaConf.create(partial if partial is not None else {})
    if not isinstance(partial, DictConfig):
        raise ConfigError(f"stages.{name}: must be a mapping of overrides, got {type(partial).__name__}")
    allowed = STAGE_KEYS + plugin_sections(base)
    for key in partial:
        if key not in allowed:
            raise ConfigError(f"stages.{name}.{key}: a stage may only set {', '.join(allowed)}")
    if isinstance(partial.get("device"), str):  # `device: csx` as shorthand for `device: {type: CSX}`
        partial.device = {"type": partial.device}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(base), partial)
        merged.stages = {}
        _device_types_upper(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(describe_error(e, prefix=f"stages.{name}.")) from e


def resolve_run_dir(cfg: DictConfig) -> str:
    """``hydra.run.dir`` resolved as a run does before anything else (with ``HydraConfig`` set, for
    ``${hydra:...}``), so that its interpolation errors are ``ConfigError``s naming it too."""
    from hydra.core.hydra_config import HydraConfig

    saved = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(cfg)
        return str(OmegaConf.select(cfg, "hydra.run.dir"))
    finally:
        HydraConfig.instance().cfg = saved


def compose(overrides: Sequence[str] = (), config_dir: str | None = None, config_name: str = "config", *,
            backends: Mapping[str, type], config_files: Iterable[str] = (),
            sections: Mapping[str, type] | None = None, disabled: Iterable[str] = ()) -> RunConfig:
    """Compose the run config from Hydra overrides, and return the typed ``RunConfig``.

    ``config_dir`` adds a user config directory to the search path (like ``--config-dir``), before
    csframework's own, so it may also hold the primary config ``config_name``; ``config_files`` are the
    config directories of backend plugins (``register_config_files``); ``backends`` and ``sections`` as in
    ``to_run_config``; ``disabled``: the disabled plugins, whose sections are gone (setting one says so).
    Raises ``ConfigError`` naming the offending key. (``csf.compose`` is this with the plugins'
    contributions.)
    """
    overrides = list(overrides)
    for item in overrides:
        problem = disabled_section(item.split("=", 1)[0].lstrip("+~"), disabled, sections)
        if problem:
            raise ConfigError(problem)
    cfg = compose_dict(overrides, config_dir, config_name, config_files=config_files, sections=sections)
    return to_run_config(cfg, explicit_groups(overrides), backends=backends, sections=sections)


def compose_dict(overrides: Sequence[str] = (), config_dir: str | None = None, config_name: str = "config", *,
                 config_files: Iterable[str] = (), sections: Mapping[str, type] | None = None) -> DictConfig:
    """The composed ``DictConfig`` (with the ``hydra`` node, its run directory checked), searching
    ``config_dir`` and then csframework's configs as the CLI's ``--config-dir`` does. Raises ``ConfigError``."""
    import yaml
    from hydra import compose as hydra_compose
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    register_schemas(sections)
    register_config_files(config_files)
    search_path = create_config_search_path("pkg://csframework.conf")
    if config_dir is not None:
        if not os.path.isdir(config_dir):
            raise ConfigError(f"config_dir: no such directory: {config_dir}")
        search_path.prepend(provider="command-line", path=f"file://{os.path.abspath(config_dir)}",
                            anchor=SearchPathQuery(provider="schema"))
    check_config_files(user_config_dirs(overrides, config_dir))
    GlobalHydra.instance().clear()
    try:
        Hydra.create_main_hydra2(task_name="csframework", config_search_path=search_path)  # sets GlobalHydra
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        resolve_run_dir(cfg)
        return cfg
    except (HydraException, OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ConfigError(describe_error(e)) from e
    finally:
        GlobalHydra.instance().clear()


def register_config_files(directories: Iterable[str]) -> None:
    """Put the config files of each directory (``pkg://package`` or ``file://path``, holding
    ``<group>/<option>.yaml``) into Hydra's ConfigStore, so their group options compose wherever Hydra
    composes (the CLI's ``@hydra.main`` and ``compose``), e.g. a backend plugin's ``device/toy.yaml``."""
    import importlib.resources

    import yaml

    for directory in directories:
        scheme, _, where = directory.partition("://")
        try:
            root = Path(str(importlib.resources.files(where))) if scheme == "pkg" else Path(where)
        except ModuleNotFoundError as e:
            raise ConfigError(f"{directory}: no such package; a backend plugin's config_path must name one") from e
        for file in sorted(root.rglob("*.yaml")):
            group = file.parent.relative_to(root).as_posix()
            try:
                node = OmegaConf.load(file)
            except (yaml.YAMLError, OmegaConfBaseException) as e:
                raise ConfigError(f"{file}: {describe_error(e)}") from e
            ConfigStore.instance().store(group=None if group == "." else group, name=file.stem, node=node)


def stage_configs(config: RunConfig) -> list[tuple[str, RunConfig]]:
    """``(prefix, config)`` of every stage that merges (``stages.<name>.``); the validation plugin reports
    the ones that do not."""
    found = []
    for name, partial in config.stages.items():
        try:
            found.append((f"stages.{name}.", stage_config(config, name, partial)))
        except ConfigError:
            continue
    return found


def for_each_stage(config: RunConfig, rule: Callable[[RunConfig], list[str]]) -> list[str]:
    """``rule``'s problems with the run's config and with each stage's of the same device type, each problem
    once: a stage's own are prefixed with ``stages.<name>.`` (a stage inherits the run's problems)."""
    base = rule(config)
    problems = list(base)
    for prefix, cfg in stage_configs(config):
        if cfg.device.type == config.device.type:
            problems += [prefix + p for p in rule(cfg) if p not in base]
    return problems
