"""Composition with the plugins: ``csf.compose`` and the CLI ask the plugins (entry points and built-ins)
for what composition needs (each device type's ``backend`` schema, the backends' config directories,
``csframework_register_configs``) and hand it to ``csframework.config``, which knows no plugin."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from . import config
from .backends.base import BackendSpec
from .builtin import builtin_plugins
from .plugins import Hooks, backend_specs, build_manager


@dataclass
class Composition:
    """What the plugins contribute to composition."""

    backends: dict[str, BackendSpec]
    """Each device type's backend."""

    @property
    def schemas(self) -> dict[str, type]:
        return {t: spec.schema for t, spec in self.backends.items()}

    @property
    def config_files(self) -> list[str]:
        """The backends' config directories."""
        return list(dict.fromkeys(spec.config_path for spec in self.backends.values() if spec.config_path))


def composition(plugins: Iterable[Any] = ()) -> Composition:
    """Ask the entry-point plugins, ``plugins`` and the built-ins; puts the schema, the backends' config
    files and the plugins' configs (``csframework_register_configs``) into Hydra's ConfigStore."""
    hooks = Hooks(build_manager(builtin_plugins(), extra=plugins))
    found = Composition(backend_specs(hooks))
    config.register_schemas()
    config.register_config_files(found.config_files)
    hooks.csframework_register_configs(config_store=ConfigStore.instance())
    return found


def compose(overrides: Sequence[str] = (), config_dir: str | None = None, config_name: str = "config",
            plugins: Iterable[Any] = ()) -> config.RunConfig:
    """Compose the run config as the CLI does, from Hydra overrides, and return the typed ``RunConfig``.

    ``config_dir`` adds a user config directory to the search path (like ``--config-dir``); ``plugins``
    are asked for backends and configs besides the installed (entry-point) and built-in ones.
    Raises ``ConfigError`` naming the offending key.
    """
    found = composition(plugins)
    return config.compose(overrides, config_dir=config_dir, config_name=config_name, backends=found.schemas)


def to_run_config(cfg: DictConfig, selected: Sequence[str] = (), plugins: Iterable[Any] = ()) -> config.RunConfig:
    """``config.to_run_config`` with the plugins' backend schemas (a config Hydra composed)."""
    return config.to_run_config(cfg, selected, backends=composition(plugins).schemas)
