"""Stages: each stage's config is the run's merged with the stage's partial config."""
from __future__ import annotations

from typing import Any, Callable, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError
from .describe import describe_error
from .loose_values import loose_values
from .optimizer import mark_user_set
from .run import STAGE_KEYS, RunConfig
from .schema import plugin_sections
from .typed import device_types_upper


def stage_config(base: RunConfig, name: str, partial: Any) -> RunConfig:
    """The config of stage ``name``: ``base`` merged with the stage's partial config."""
    partial = OmegaConf.create(partial if partial is not None else {})
    if not isinstance(partial, DictConfig):
        raise ConfigError(f"stages.{name}: must be a mapping of overrides, got {type(partial).__name__}")
    allowed = STAGE_KEYS + plugin_sections(base)
    for key in partial:
        if key not in allowed:
            raise ConfigError(f"stages.{name}.{key!s}: a stage may only set {', '.join(allowed)}")
    if isinstance(partial.get("device"), str):  # `device: csx` as shorthand for `device: {type: CSX}`
        partial.device = {"type": partial.device}
    values = OmegaConf.to_container(partial, resolve=False)
    backend = cast("dict[str, Any]", values).get("backend")
    loose = (loose_values(values, type(base), f"stages.{name}.")
             + loose_values(backend, type(base.backend), f"stages.{name}.backend."))
    if loose:  # one line: the validation plugin reports a stage that does not merge as one problem
        raise ConfigError("; ".join(loose))
    try:
        merged = cast(DictConfig, OmegaConf.merge(OmegaConf.structured(base), partial))
        merged.stages = {}
        device_types_upper(merged)
        config = cast(RunConfig, OmegaConf.to_object(merged))
    except OmegaConfBaseException as e:
        raise ConfigError(describe_error(e, prefix=f"stages.{name}.")) from e
    # what the run's overrides set, and what the stage sets, is the user's
    written = cast("dict[str, Any]", OmegaConf.to_container(partial, resolve=False))
    stage_sets = dotted_keys(written.get("optimizer"), "optimizer")
    mark_user_set(config.optimizer, base.optimizer.from_group,
                  [f"optimizer.{key}" for key in base.optimizer.overridden] + stage_sets)
    return config


def dotted_keys(node: Any, prefix: str) -> list[str]:
    """The dotted keys of the values in ``node`` (nested dicts; a value that is no dict is one), under
    ``prefix``: ``{"schedule": {"min_lr": 0}}`` -> ``[prefix.schedule.min_lr]``; none for ``None``."""
    if node is None:
        return []
    if not isinstance(node, dict) or not node:
        return [prefix]
    return [key for name, value in node.items() for key in dotted_keys(value, f"{prefix}.{name}")]


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


def run_stages(config: RunConfig) -> list[tuple[str, RunConfig]]:
    """``(name, merged config)`` of every stage of a run, in order: ``("main", config)`` without ``stages``."""
    if not config.stages:
        return [("main", config)]
    return [(name, stage_config(config, name, partial)) for name, partial in config.stages.items()]
