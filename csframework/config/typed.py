"""Typing: a composed ``DictConfig`` into the typed ``RunConfig``, ``backend`` typed by the schema of its
device type (or its named backend)."""
from __future__ import annotations

import re
from dataclasses import MISSING, fields
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError, ValidationError
from .describe import describe_error, describe_missing_interpolation
from .optimizer import BUILTIN_OPTIONS, mark_user_set
from .run import RunConfig
from .loose_values import loose_values
from .schema import cached_schema, disabled_section, run_config_type


def explicit_groups(overrides: Iterable[str]) -> list[str]:
    """The device-choosing groups (``device``, ``backend``) selected in ``overrides``."""
    chosen = set()
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in ("device", "backend") and "=" in item:
            chosen.add(key)
    return sorted(chosen)


def to_run_config(cfg: DictConfig, selected: Sequence[str] = (), *, backends: Mapping[str, type],
                  sections: Mapping[str, type] | None = None,
                  named: Mapping[str, tuple[str, type]] | None = None) -> RunConfig:
    """Turn a composed ``DictConfig`` into the typed ``RunConfig`` (interpolations resolved), with the
    plugins' config ``sections`` as typed top-level fields.

    ``backends`` maps each device type to its ``backend`` schema: ``backend`` becomes an instance of the
    schema of ``backend.type``, so an unknown key or a wrong type names ``backend.<key>``, and a setting
    only another device type's backend has is refused naming that type. When only the ``backend`` group was
    chosen, the device type follows it (``backend=csx`` alone means a CSX run); choosing both groups is left
    for the validation plugin to refuse. ``named`` maps each named backend (``backend=<name>``, whose node
    has ``name: <name>``) to its device type and schema: ``backend=cerebras`` alone means a CSX run.
    """
    named = named or {}
    choices, overridden = composition_record(cfg)
    try:
        # a copy of the node without ``hydra`` (copying Hydra's own config would cost more than the rest)
        cfg = OmegaConf.masked_copy(cfg, [str(key) for key in cfg if key != "hydra"])
        OmegaConf.set_struct(cfg, False)
        if "backend" in selected and "device" not in selected:
            chosen = named.get(cfg.backend.get("name"))
            cfg.device.type = chosen[0] if chosen is not None else cfg.backend.type
        values = OmegaConf.to_container(cfg, resolve=False)
        loose = loose_values(values, run_config_type(sections))  # what OmegaConf's typing would let through
        if loose:
            raise ValidationError(loose)
        # merged as a plain container, so a key the schema lacks (``+foo=1``) is refused naming it
        typed = cast(DictConfig, OmegaConf.merge(cached_schema(sections), values))
        device_types_upper(typed)
        run = cast(RunConfig, OmegaConf.to_object(typed))  # resolves, naming the key of a failing interpolation
    except OmegaConfBaseException as e:
        disabled = OmegaConf.select(cfg, "plugins.disable", default=None) or []
        problem = disabled_section(getattr(e, "full_key", None) or "", disabled, sections)
        raise ConfigError(problem or describe_missing_interpolation(e, cfg, choices, overridden)
                          or describe_error(e)) from e
    run.backend = _typed_backend(run.backend, run.device.type, backends, named)
    run.selected = tuple(selected)  # type: ignore[misc]  # this run's groups, over the ClassVar's default (not a field: never composed)
    mark_user_set(run.optimizer, choices.get("optimizer") in BUILTIN_OPTIONS, overridden)
    return run


def composition_record(cfg: DictConfig) -> tuple[dict[str, Any], set[str]]:
    """How ``cfg`` was composed: the option of each config group (``{"model": "my_model", ...}``) and the
    keys the overrides set; from its ``hydra`` node, or inside a job (whose config has none) from Hydra's
    record of the job. Empty when neither is there (a config built by hand)."""
    hydra = OmegaConf.select(cfg, "hydra", default=None)
    if hydra is None:
        from hydra.core.hydra_config import HydraConfig

        hydra = HydraConfig.get() if HydraConfig.initialized() else None
    choices = OmegaConf.select(hydra, "runtime.choices", default=None) if hydra is not None else None
    task = OmegaConf.select(hydra, "overrides.task", default=None) if hydra is not None else None
    # as typed: an override's `${...}` is not resolved
    typed = cast("list[str]", OmegaConf.to_container(task, resolve=False)) if task is not None else []
    overridden = {str(o).split("=", 1)[0].lstrip("+~") for o in typed}
    return dict(choices or {}), overridden


def device_types_upper(cfg: DictConfig) -> None:
    """``device.type`` and ``backend.type`` are case-insensitive (``cpu`` is ``CPU``), as ``device=cpu`` is."""
    for section in ("device", "backend"):
        node = cfg.get(section)
        if isinstance(node, DictConfig) and isinstance(node.get("type"), str):
            node.type = node.type.upper()


def _typed_backend(values: Any, device_type: str, backends: Mapping[str, type],
                   named: Mapping[str, tuple[str, type]]) -> Any:
    """``values`` (the ``backend`` node) as an instance of its schema: its named backend's (``name``), else
    its type's."""
    known = ", ".join(f"device={t.lower()}" for t in backends)
    problems = []
    if device_type not in backends:
        problems.append(f"device.type: '{device_type}' is not a device type; use {known}")
    schema: type | None
    name = values.get("name")
    if name is not None:
        if name not in named:
            problems.append(f"backend.name: '{name}' is not an installed backend"
                            + (f"; installed: {', '.join(named)}" if named else "")
                            + " (install its plugin package, or choose the backend with device=<type>)")
            raise ValidationError(problems)
        backend_type, schema = named[name]
        if backend_type != device_type:
            problems.append(f"backend.name: the {name} backend runs device type {backend_type}, and this run's "
                            f"device is {device_type}; choose it with backend={name} alone")
        kind = name
    else:
        kind = values.get("type", device_type)
        schema = backends.get(kind)
    if schema is None:
        problems.append(f"backend.type: '{kind}' is not a device type; use {', '.join(backends)}")
        raise ValidationError(problems)
    own = {f.name for f in fields(schema)}
    schemas = {**backends, **{n: s for n, (_, s) in named.items()}}
    for key in sorted(set(values) - own):
        owners = [t for t, other in schemas.items() if key in {f.name for f in fields(other)}]
        if owners and _left_unset(values.get(key), [schemas[t] for t in owners], key):
            continue  # another device's setting left as it is: a config moves between devices (dropped below)
        instead = getattr(schema, "INSTEAD", {}).get(key)  # the schema's own way to the same end
        if owners and instead:
            problems.append(f"backend.{key}: only {'/'.join(owners)} understands it, and this run's device is "
                            f"{kind}; {instead}")
        elif owners:
            choose = f"backend={owners[0]}" if owners[0] in named else f"device={owners[0].lower()}"
            problems.append(f"backend.{key}: only {'/'.join(owners)} understands it, and this run's device is "
                            f"{kind}; remove it or use {choose}")
        else:
            problems.append(f"backend.{key}: the {kind} backend has no such setting (its settings: "
                            f"{', '.join(sorted(own - {'type'}))})")
    problems += loose_values(values, schema, "backend.")
    if problems:
        raise ValidationError(problems)
    values = {key: value for key, value in values.items() if key in own}
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), _literal(values)))
    except OmegaConfBaseException as e:
        raise ConfigError(f"backend.{describe_error(e)}") from e


def _left_unset(value: Any, owners: Sequence[type], key: str) -> bool:
    """Whether ``value`` of another backend's setting ``key`` is ``null`` or that backend's default: a config
    written for one device (``backend.threads: 4`` -> ``null``, ``backend.compile: false``) then runs on any."""
    if value is None:
        return True
    for schema in owners:
        field = next(f for f in fields(schema) if f.name == key)
        default = field.default_factory() if field.default_factory is not MISSING else field.default
        if default is not MISSING and _same(value, default):
            return True
    return False


def _same(value: Any, default: Any) -> bool:
    """``value`` as composed equals ``default`` (an enum's default equals its name: ``single``)."""
    if isinstance(default, Enum):
        return bool(value == default.name or value == default.value)
    return bool(type(value) is type(default) and value == default or (
        isinstance(default, float) and type(value) is int and value == default))


_INTERPOLATION = re.compile(r"(\\*)\$\{")


def _literal(value: Any) -> Any:
    """Values already resolved, escaped so that OmegaConf keeps them as they are: a string that came from an
    environment variable (``backend.graph_compiler``'s ``$CSF_CSX_GRAPH_COMPILER``) is data, never resolved
    as an interpolation a second time."""
    if isinstance(value, str):
        # OmegaConf's escapes: ``\${`` is a literal ``${``, and each backslash before it is written doubled
        return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, Mapping):
        return {key: _literal(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_literal(item) for item in value]
    return value
