"""Typed config schemas and composition: overrides -> Hydra -> ``RunConfig``."""
from __future__ import annotations

import copy
import os
from typing import Iterable, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError
from .backend import BackendConfig, DeviceConfig, FIELDS_BY_TYPE, Strategy
from .optimizer import FIELDS_BY_OPTIMIZER, OptimizerConfig, ScheduleConfig
from .precision import PRECISIONS, PrecisionConfig
from .run import STAGE_KEYS, Mode, RunConfig
from .sections import CheckpointConfig, DataConfig, LoopConfig, PluginsConfig

__all__ = [
    "RunConfig", "DeviceConfig", "BackendConfig", "OptimizerConfig", "ScheduleConfig", "PrecisionConfig",
    "DataConfig", "LoopConfig", "CheckpointConfig", "PluginsConfig", "Mode", "Strategy", "STAGE_KEYS",
    "FIELDS_BY_TYPE", "FIELDS_BY_OPTIMIZER", "PRECISIONS", "compose", "register_schemas",
    "to_run_config", "stage_config", "explicit_groups", "describe_error",
]

SCHEMA_NAME = "csframework_schema"


def register_schemas() -> None:
    """Put the ``RunConfig`` schema into Hydra's ConfigStore; ``conf/config.yaml`` builds on it."""
    node = OmegaConf.structured(RunConfig)
    # the keyword arguments of a `_target_` optimizer or schedule are open: `optimizer.args.alpha=0.9`
    # adds a key without Hydra's `+` (every other section stays closed, so a typo is an error)
    OmegaConf.set_struct(node.optimizer.args, False)
    OmegaConf.set_struct(node.optimizer.schedule.args, False)
    ConfigStore.instance().store(name=SCHEMA_NAME, node=node)


def explicit_groups(overrides: Iterable[str]) -> list[str]:
    """The device-choosing groups (``device``, ``backend``) selected in ``overrides``."""
    chosen = set()
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in ("device", "backend") and "=" in item:
            chosen.add(key)
    return sorted(chosen)


def describe_error(error: BaseException) -> str:
    """One line for a composition error, naming the full key where OmegaConf knows it (or the override,
    the config group or the file)."""
    seen = error
    while seen is not None:
        found = _describe_known(seen)
        if found:
            return found
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            msg = str(getattr(seen, "msg", None) or seen).splitlines()[0]
            return f"{seen.full_key}: {msg}"
        seen = seen.__cause__ or seen.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else type(error).__name__


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
            return (f"{group.replace('/', '.')}: no option '{option}' in config group '{group}' "
                    f"(available: {', '.join(error.options) or 'none'})")
        first = str(error).splitlines()[0].strip()
        return f"{missing or 'config'}: {first}" if missing and missing not in first else first
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return (f"{mark.name}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: "
                f"{error.problem or error.context}")
    if isinstance(error, yaml.YAMLError):
        return f"invalid YAML: {str(error).splitlines()[0]}"
    return None


def to_run_config(cfg: DictConfig, selected: Sequence[str] = ()) -> RunConfig:
    """Turn a composed ``DictConfig`` into the typed ``RunConfig`` (interpolations resolved).

    When only the ``backend`` group was chosen, the device type follows it (``backend=csx`` alone means a
    CSX run); choosing both groups is left for the validation plugin to refuse.
    """
    try:
        cfg = copy.deepcopy(cfg)
        OmegaConf.set_struct(cfg, False)
        cfg.pop("hydra", None)
        if "backend" in selected and "device" not in selected:
            cfg.device.type = cfg.backend.type
        cfg.selected = list(selected)
        # merged as a plain container, so a key the schema lacks (``+foo=1``) is refused naming it
        typed = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.to_container(cfg, resolve=False))
        OmegaConf.resolve(typed)
        return OmegaConf.to_object(typed)
    except OmegaConfBaseException as e:
        raise ConfigError(describe_error(e)) from e


def stage_config(base: RunConfig, name: str, partial) -> RunConfig:
    """The config of stage ``name``: ``base`` merged with the stage's partial config."""
    partial = OmegaConf.create(partial if partial is not None else {})
    if not isinstance(partial, DictConfig):
        raise ConfigError(f"stages.{name}: must be a mapping of overrides, got {type(partial).__name__}")
    for key in partial:
        if key not in STAGE_KEYS:
            raise ConfigError(f"stages.{name}.{key}: a stage may only set {', '.join(STAGE_KEYS)}")
    if isinstance(partial.get("device"), str):  # `device: csx` as shorthand for `device: {type: CSX}`
        partial.device = {"type": partial.device.upper()}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(base), partial)
        merged.stages = {}
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"stages.{name}.{describe_error(e)}") from e


def compose(overrides: Sequence[str] = (), config_dir: str | None = None,
            config_name: str = "config") -> RunConfig:
    """Compose the run config as the CLI does, from Hydra overrides, and return the typed ``RunConfig``.

    ``config_dir`` adds a user config directory to the search path (like ``--config-dir``).
    Raises ``ConfigError`` naming the offending key.
    """
    import yaml
    from hydra import compose as hydra_compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from ..plugins import register_configs_from_entry_points

    register_schemas()
    register_configs_from_entry_points()
    overrides = list(overrides)
    if config_dir is not None:
        if not os.path.isdir(config_dir):
            raise ConfigError(f"config_dir: no such directory: {config_dir}")
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(config_dir)}]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("csframework.conf", version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ConfigError(describe_error(e)) from e
    finally:
        GlobalHydra.instance().clear()
    return to_run_config(cfg, explicit_groups(overrides))
