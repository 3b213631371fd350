"""Typed config schemas and typing: the sections' dataclasses, ``RunConfig`` with the plugins' sections,
a composed config into the typed ``RunConfig``, stages, the user's config files' limits and the error prose.

This package knows neither the plugins (what it needs from them comes in as arguments) nor Hydra's
bootstrap: composition is ``csframework.hydra_session``'s. Each concern is one module; this one only
re-exports their public names.
"""
from __future__ import annotations

from .backend import BackendConfig, DeviceConfig
from .describe import describe_error
from .optimizer import FIELDS_BY_OPTIMIZER, OptimizerConfig, ParamGroupConfig, ScheduleConfig
from .precision import PRECISIONS, PrecisionConfig
from .run import STAGE_KEYS, Mode, RunConfig
from .schema import cached_schema, disabled_section, flat_config, plugin_sections, run_config_type
from .sections import CheckpointConfig, DataConfig, LoopConfig, PluginsConfig
from .readonly import plain
from .stages import for_each_stage, run_stages, stage_config, stage_configs
from .typed import explicit_groups, to_run_config
from .user_files import (MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_NODES, check_config_files,
                         user_config_dirs)

__all__ = [
    "RunConfig", "DeviceConfig", "BackendConfig", "OptimizerConfig", "ParamGroupConfig", "ScheduleConfig",
    "PrecisionConfig",
    "DataConfig", "LoopConfig", "CheckpointConfig", "PluginsConfig", "Mode", "STAGE_KEYS",
    "FIELDS_BY_OPTIMIZER", "PRECISIONS", "to_run_config", "stage_config", "stage_configs",
    "run_stages", "for_each_stage",
    "explicit_groups", "describe_error", "user_config_dirs", "check_config_files", "run_config_type",
    "cached_schema", "plugin_sections", "disabled_section", "flat_config", "MAX_CONFIG_BYTES",
    "MAX_CONFIG_NODES", "MAX_CONFIG_DEPTH", "plain",
]
