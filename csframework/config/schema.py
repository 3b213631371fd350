"""``RunConfig`` as composition sees it: extended by the plugins' config sections (one class per set of
sections), and the schema Hydra composes onto (``backend`` and the ``_target_`` arguments open), built once
per set of sections."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import fields
from typing import Any, Iterable, Mapping

from omegaconf import AnyNode, DictConfig, OmegaConf, open_dict
from omegaconf.nodes import BooleanNode

from .readonly import ReadOnly
from .run import RunConfig

_types: dict[tuple[tuple[str, type], ...], type] = {}


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


def plugin_sections(config: Any) -> tuple[str, ...]:
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


def _schema(sections: Mapping[str, type] | None = None, composing: bool = False) -> DictConfig:
    """``RunConfig`` (with the plugins' ``sections``) as Hydra composes it: typed, except the ``backend``
    node, which takes any key until ``to_run_config`` types it with the schema of its device type, and with
    ``composing`` the booleans (``untyped_booleans``)."""
    schema: DictConfig = OmegaConf.structured(run_config_type(sections))
    if composing:
        untyped_booleans(schema)
    with open_dict(schema):
        schema.backend = {"type": "CPU"}
    OmegaConf.set_struct(schema.backend, False)
    # the keyword arguments of a `_target_` optimizer or schedule are open: `optimizer.args.alpha=0.9`
    # adds a key without Hydra's `+` (every other section stays closed, so a typo is an error)
    OmegaConf.set_struct(schema.optimizer.args, False)
    OmegaConf.set_struct(schema.optimizer.schedule.args, False)
    return schema


def untyped_booleans(node: DictConfig) -> None:
    """Every boolean of ``node`` (nested sections too) as an untyped value with the same default: OmegaConf
    would turn a number given for it (``checkpoint.start_over=2``, ``-1``) into true while Hydra composes, so
    ``to_run_config`` could not refuse it (``loose_values``), as it refuses any other wrong type. (Replacing
    a typed node is not in OmegaConf's public API; omegaconf is pinned to 2.3.)"""
    for key in list(node.keys()):
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            untyped_booleans(child)
        elif isinstance(child, BooleanNode):
            node.__dict__["_content"][key] = AnyNode(child._value(), key=key, parent=node)


_schemas: dict[tuple[type, bool], DictConfig] = {}


def cached_schema(sections: Mapping[str, type] | None = None, composing: bool = False) -> DictConfig:
    """``_schema(sections, composing)``, built once per set of sections (building it costs more than copying
    it): only for callers that copy it and leave it as it was (``OmegaConf.merge``, ``ConfigStore.store``).
    ``composing``: the schema Hydra composes onto (its booleans untyped); else the one that types the run."""
    kind = (run_config_type(sections), composing)
    if kind not in _schemas:
        _schemas[kind] = _schema(sections, composing)
    return _schemas[kind]


def flat_config(config: Any) -> dict[str, Any]:
    """A run config as ``{"dotted.key": value}`` (plain values: enums as their value, lists as lists),
    e.g. for loggers that record parameters."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node.value if isinstance(node, enum.Enum) else node

    walk(OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True), "")
    return flat
