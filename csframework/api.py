"""Composition with the plugins: ``csf.compose`` and the CLI ask the plugins (entry points, ``plugins.enable``
and built-ins, minus ``plugins.disable``) for what composition needs (each device type's ``backend``
schema, the backends' config directories, the plugins' config sections, ``csframework_register_configs``)
and hand it to ``csframework.hydra_session`` (composition) and ``csframework.config`` (typing), which know
no plugin."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, TypeVar

import pluggy
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from . import config, hydra_session
from .errors import ConfigError
from .protocol import BackendSpec
from .builtin import builtin_plugins
from .plugins import (COMPOSITION_HOOKS, Hooks, backend_specs, build_manager, config_sections, named_backend_specs,
                      plugin_choices)


@dataclass
class Composition:
    """What the plugins contribute to composition, and the plugin manager that asked them."""

    backends: dict[str, BackendSpec]
    """Each device type's backend."""
    manager: pluggy.PluginManager
    """The plugins, registered (``plugins.build_manager``); handed to the ``Run`` when built ``for_run``."""
    sections: dict[str, type] = field(default_factory=dict)
    """The plugins' own config sections (``csframework_config_sections``)."""
    enabled: list[str] = field(default_factory=list)
    """The ``plugins.enable`` modules asked."""
    disabled: list[str] = field(default_factory=list)
    """The disabled plugins (their sections are gone)."""
    named_backends: dict[str, BackendSpec] = field(default_factory=dict)
    """The backends chosen by name (``backend=<name>``), by name."""
    for_run: bool = False
    """Every plugin is registered (a class instantiated): ``manager`` can serve the run."""

    @property
    def schemas(self) -> dict[str, type]:
        return {t: spec.schema for t, spec in self.backends.items()}

    @property
    def named(self) -> dict[str, tuple[str, type]]:
        """Each named backend's device type and schema, by name (what ``config.to_run_config`` takes)."""
        return {name: (spec.device_type, spec.schema) for name, spec in self.named_backends.items()}

    @property
    def config_files(self) -> list[str]:
        """The backends' config directories."""
        specs = [*self.backends.values(), *self.named_backends.values()]
        return list(dict.fromkeys(spec.config_path for spec in specs if spec.config_path))

    def run_manager(self, run_config: config.RunConfig) -> pluggy.PluginManager | None:
        """``manager`` for the run of ``run_config`` (``Run(..., manager=)``) when it holds that run's plugins:
        built ``for_run`` with the ``plugins.enable`` / ``plugins.disable`` the config ended up with (a config
        file may set them); else ``None``, and the run builds its own."""
        chosen = run_config.plugins
        if self.for_run and list(chosen.enable) == self.enabled and list(chosen.disable) == self.disabled:
            return self.manager
        return None


def composition(plugins: Iterable[Any] = (), enable: Iterable[str] = (), disable: Iterable[str] = (),
                for_run: bool = False) -> Composition:
    """Ask the entry-point plugins, the ``enable`` modules, ``plugins`` and the built-ins, minus ``disable``
    (never imported); puts the schema (with the plugins' config sections), the backends' config files and
    the plugins' configs (``csframework_register_configs``) into Hydra's ConfigStore. Only a class plugin
    that takes part in composition is instantiated, unless ``for_run`` (the manager then serves the run)."""
    enable, disable = list(enable), list(disable)
    pm = build_manager(builtin_plugins(), enable, plugins, disable, asking=None if for_run else COMPOSITION_HOOKS)
    hooks = Hooks(pm)
    found = Composition(backend_specs(hooks), pm, config_sections(pm), enable, disable, named_backend_specs(hooks),
                        for_run)
    hydra_session.register_schemas(found.sections)
    hydra_session.register_config_files(found.config_files)
    hooks.csframework_register_configs(config_store=ConfigStore.instance())
    return found


def command_line_composition(overrides: Sequence[str], plugins: Iterable[Any] = (),
                             for_run: bool = False) -> Composition:
    """``composition`` with the ``plugins.enable`` / ``plugins.disable`` the overrides set."""
    enable, disable = plugin_choices(overrides)
    return composition(plugins, enable, disable, for_run)


T = TypeVar("T")


def settled(overrides: Sequence[str], config_dir: str | None, config_name: str,
            compose: Callable[[Composition], T], chosen: Callable[[T], tuple[list[str], list[str]] | None],
            plugins: Iterable[Any] = (), for_run: bool = False,
            found: Composition | None = None) -> tuple[Composition, T]:
    """``compose(found)`` with the plugins the overrides choose (``command_line_composition``), and once more
    with those the composed config chooses (``chosen`` of the result; ``None``: nothing to compare) where its
    config files enable or disable others (an experiment file's ``plugins: {enable: [...]}``): their sections,
    configs and backends then count as they do when the command line names them. When the first composition
    fails (the file sets the section of a plugin only it enables), the files' choices are read from a
    composition that lets unknown sections through (``hydra_session.plugins_of_config_files``). ``found``:
    the overrides' composition, when the caller has it already."""
    found = found or command_line_composition(overrides, plugins, for_run)
    asked = (found.enabled, found.disabled)
    try:
        result = compose(found)
        choices = chosen(result)
    except ConfigError:
        choices = hydra_session.plugins_of_config_files(overrides, config_dir, config_name, found.sections)
        if choices is None or choices == asked:
            raise
    else:
        if choices is None or choices == asked:
            return found, result
    found = composition(plugins, *choices, for_run=for_run)
    return found, compose(found)


def compose(overrides: Sequence[str] = (), config_dir: str | None = None, config_name: str = "config",
            plugins: Iterable[Any] = ()) -> config.RunConfig:
    """Compose the run config as the CLI does, from Hydra overrides, and return the typed ``RunConfig``.

    ``config_dir`` adds a user config directory to the search path (like ``--config-dir``); ``plugins``
    are asked for backends and configs besides the installed (entry-point) and built-in ones, as are the
    plugins the config files enable (``settled``). Raises ``ConfigError`` naming the offending key.
    """
    def composed(found: Composition) -> config.RunConfig:
        return hydra_session.compose(overrides, config_dir=config_dir, config_name=config_name,
                                     backends=found.schemas, sections=found.sections, disabled=found.disabled,
                                     named=found.named)

    return settled(overrides, config_dir, config_name, composed,
                   lambda run: (list(run.plugins.enable), list(run.plugins.disable)), plugins)[1]


def config_composition(cfg: DictConfig, plugins: Iterable[Any] = (), for_run: bool = False) -> Composition:
    """``composition`` for a config Hydra composed, whose own ``plugins.enable`` / ``plugins.disable`` say
    which plugins count."""
    return composition(plugins, *hydra_session.plugin_choices(cfg), for_run=for_run)


def typed(found: Composition, cfg: DictConfig, selected: Sequence[str] = ()) -> config.RunConfig:
    """``config.to_run_config`` with the backend schemas and sections of ``found``."""
    return config.to_run_config(cfg, selected, backends=found.schemas, sections=found.sections, named=found.named)


def to_run_config(cfg: DictConfig, selected: Sequence[str] = (), plugins: Iterable[Any] = ()) -> config.RunConfig:
    """``config.to_run_config`` with the plugins' backend schemas and sections (a config Hydra composed,
    whose own ``plugins.enable`` / ``plugins.disable`` say which plugins count)."""
    return typed(config_composition(cfg, plugins), cfg, selected)
