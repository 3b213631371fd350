"""The Hydra session: the one module that talks to Hydra's bootstrap (ConfigStore, ``@hydra.main``, the
compose API), on Hydra's public API only.

The CLI is Hydra's ``@hydra.main`` (``main_app``) with one task function: Hydra composes the run or the
sweep's jobs and chooses what the command line asks for. Outside it, composition is one function
(``_compose``: the config checks, then ``hydra.compose`` in a ``_session`` on the same configs), which
``compose_dict`` / ``compose`` (``csf.compose``, a sweep's check of its values) call.

Composition knows no plugin: what it needs from them comes in as arguments (``backends``: the ``backend``
schema of each device type; ``config_files``: the config directories of backend plugins; ``sections``: the
plugins' own config sections); ``csframework.api`` asks the plugins for these and passes them in.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .config import (RunConfig, cached_schema, check_config_files, describe_error, disabled_section,
                     explicit_groups, to_run_config, user_config_dirs)
from .config.describe import closest
from .errors import ConfigError, clipped, clipped_words

#: csframework's own configs (``conf/``, shipped as ``csframework.conf``): what ``@hydra.main``'s
#: ``config_path`` names and every composition searches (after a user's ``--config-dir``).
CONFIG_MODULE = "csframework.conf"
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"
#: The ``RunConfig`` schema's name in Hydra's ConfigStore; ``conf/config.yaml``'s defaults list starts with it.
SCHEMA_NAME = "csframework_schema"
TASK_NAME = "csframework"


def register_schemas(sections: Mapping[str, type] | None = None) -> None:
    """Put the ``RunConfig`` schema (with the plugins' ``sections``) into Hydra's ConfigStore;
    ``conf/config.yaml`` builds on it."""
    from hydra.core.config_store import ConfigStore

    # the store keeps a copy; its booleans untyped, so a number given for one reaches to_run_config to be refused
    ConfigStore.instance().store(name=SCHEMA_NAME, node=cached_schema(sections, composing=True))


def register_config_files(directories: Iterable[str]) -> None:
    """Put the config files of each directory (``pkg://package`` or ``file://path``, holding
    ``<group>/<option>.yaml``) into Hydra's ConfigStore, so their group options compose wherever Hydra
    composes (the CLI's ``@hydra.main`` and ``compose``), e.g. a backend plugin's ``device/toy.yaml``."""
    import importlib.resources

    import yaml
    from hydra.core.config_store import ConfigStore

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


def import_object(path: str) -> Any:
    """The object at the dotted ``path`` (a class, function or module attribute), as Hydra's ``_target_``
    finds it (``hydra.utils.get_object``); raises what the import raised. The callers report it themselves,
    in one line, so ``get_object``'s own error log is silenced."""
    import logging

    from hydra.utils import get_object

    log = logging.getLogger("hydra.utils")
    disabled, log.disabled = log.disabled, True
    try:
        return get_object(path)
    finally:
        log.disabled = disabled


def main_app(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """``task`` as Hydra's ``@hydra.main`` app on csframework's configs: the CLI (a run, a sweep, ``--help``,
    ``--cfg``, ``--info``: Hydra's own dispatch chooses)."""
    import hydra

    return hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")(task)


@contextlib.contextmanager
def _session(primary_dir: str | None = None) -> Iterator[Any]:
    """Hydra initialised on csframework's configs (what ``@hydra.main``'s ``config_path`` gives) through the
    public ``initialize_config_module`` (``initialize_config_dir`` on ``primary_dir`` instead, which then
    comes first), for one composition; yields its config loader. A session running before (a multirun's,
    whose start checks its jobs' values) is back afterwards."""
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    running = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        if primary_dir is None:
            initialize_config_module(config_module=CONFIG_MODULE, job_name=TASK_NAME, version_base="1.3")
        else:
            initialize_config_dir(config_dir=primary_dir, job_name=TASK_NAME, version_base="1.3")
        yield GlobalHydra.instance().config_loader()
    finally:
        GlobalHydra.instance().clear()
        if running is not None:
            GlobalHydra.instance().initialize(running)


def _searching(overrides: list[str], directory: str) -> list[str]:
    """``overrides`` that search ``directory`` (``file://``/``pkg://``) first in ``hydra.searchpath`` (the
    public way to add a directory; a ``hydra.searchpath`` override of the user's keeps its entries after it)."""
    entries, rest = [directory], []
    for item in overrides:
        if item.split("=", 1)[0] == "hydra.searchpath":
            entries += [f"file://{d}" for d in user_config_dirs([item])]
        else:
            rest.append(item)
    return rest + ["hydra.searchpath=[" + ",".join(f"'{e}'" for e in entries) + "]"]


def check_disabled_sections(overrides: Iterable[str], sections: Mapping[str, type] | None,
                            disabled: Iterable[str]) -> None:
    """Raise ``ConfigError`` for an override setting the section of a ``disabled`` plugin (gone: not among
    ``sections``), saying so, where Hydra would only call the key unknown."""
    for item in overrides:
        problem = disabled_section(item.split("=", 1)[0].lstrip("+~"), disabled, sections)
        if problem:
            raise ConfigError(problem)


def _compose(overrides: list[str], config_dir: str | None, config_name: str,
             sections: Mapping[str, type] | None = None, disabled: Iterable[str] = ()) -> DictConfig:
    """The one composition outside ``@hydra.main`` (``csf.compose``, a sweep's check of its values): checks the
    overrides (a setting of a ``disabled`` plugin's section, which is gone: not among ``sections``) and the
    user's config files (``check_config_files``), and composes ``config_name`` with ``overrides`` for a run
    (``hydra.compose`` in a ``_session``) searching ``config_dir`` too, as the CLI's ``--config-dir`` does.
    Returns the config with its ``hydra`` node. Raises ``ConfigError`` (one line naming the key or file; a
    primary config that is not there, with the ones that are)."""
    from hydra import compose as hydra_compose
    from hydra.errors import MissingConfigException

    check_disabled_sections(overrides, sections, disabled)
    check_config_files(user_config_dirs(overrides, config_dir))
    if config_dir is not None and not os.path.isdir(config_dir):
        raise ConfigError(f"config_dir: no such directory: {config_dir}")
    user_dir = os.path.abspath(config_dir) if config_dir is not None else None
    searching = _searching(overrides, f"file://{user_dir}") if user_dir else overrides
    with composition_errors(overrides):
        with _session() as loader:
            try:
                return hydra_compose(config_name=config_name, overrides=searching, return_hydra_config=True)
            except MissingConfigException as e:
                if e.missing_cfg_file != config_name:
                    raise
                if user_dir is None or not os.path.isfile(os.path.join(user_dir, f"{config_name}.yaml")):
                    raise ConfigError(_missing_primary(config_name, loader, searching)) from e
        # a primary config of the user's directory: Hydra finds a primary config only in the directory it is
        # initialised on (one added by hydra.searchpath is searched too late), so that directory comes first
        with _session(user_dir):
            return hydra_compose(config_name=config_name, overrides=_searching(overrides, CONFIG_PATH),
                                 return_hydra_config=True)


def missing_primary(config_name: str, config_dir: str | None) -> str:
    """The error for a primary config (``--config-name``) that is in neither ``config_dir`` nor csframework's
    configs (``_missing_primary``)."""
    with _session() as loader:
        return _missing_primary(config_name, loader,
                                _searching([], f"file://{os.path.abspath(config_dir)}") if config_dir else [])


def _missing_primary(config_name: str, loader, overrides: list[str]) -> str:
    """The error for a primary config (``--config-name``) that is not in the search path: the ones that
    are, and the closest ("did you mean", as for a group's options)."""
    found = [n for n in loader.get_group_options("", overrides=overrides) if not n.startswith("_") and n != SCHEMA_NAME]
    close = closest(config_name, found)
    hint = f"; did you mean `--config-name {close}`?" if close else ""
    here = sorted(p for pattern in (f"{config_name}.yaml", f"*/{config_name}.yaml") for p in Path().glob(pattern)
                  if p.is_file())
    if here:  # in the working directory (not searched: its config directory not given), as for a group's option
        hint = f"; {here[0]} is here: give its config directory with --config-dir {here[0].parent}"
    return (f"--config-name: no primary config '{config_name}' in the config search path (available: "
            f"{', '.join(found) or 'none'}){hint}")


#: The groups of csframework's primary config's defaults list (conf/config.yaml), which a user's primary extends
IN_EVERY_DEFAULTS_LIST = frozenset({"device", "backend", "optimizer", "precision", "model", "data"})


@contextlib.contextmanager
def composition_errors(overrides: Sequence[str] = ()) -> Iterator[None]:
    """Turns Hydra's, OmegaConf's and YAML's errors into a ``ConfigError`` (``describe_error``), in one line;
    a group option it suggests is written as ``overrides`` chose the group (``+experiment=spirals`` for
    ``+experiment=spiral``; not for a group in every defaults list), so that pasted it works."""
    import yaml
    from hydra.errors import HydraException

    try:
        yield
    except (HydraException, OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        message = describe_error(e)
        suggested = re.search(r"did you mean `([\w./-]+)=", message)
        if suggested and suggested.group(1) not in IN_EVERY_DEFAULTS_LIST and \
                not suggested.group(1).startswith("hydra/"):  # (there a '+' fails: "Multiple values for ...")
            group = suggested.group(1)
            plus = next((o[:len(o) - len(o.lstrip("+"))] for o in overrides
                         if o.lstrip("+").split("=", 1)[0] == group), "")
            message = message.replace(f"`{group}=", f"`{plus}{group}=")
        raise ConfigError(clipped_words(message)) from e  # a value quoted whole: clipped
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise
        raise ConfigError(f"{clipped(e.filename)}: {e.strerror}: an override names a config group option or key "
                          "longer than a file name may be; shorten it") from e


class CallbackError(BaseException):
    """A ``CsfError`` raised in a Hydra callback, carried past Hydra's guard (which turns an ``Exception`` of a
    callback into a warning) to the CLI, which reports ``error`` in one line."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def written_configs(groups: Iterable[str], config_name: str = "config") -> tuple[Any, dict[str, dict[str, Any]]]:
    """The primary config ``config_name`` and each option of ``groups`` (name -> its config), as their files
    (or the ConfigStore entries backends and plugins put there) write them: not merged, not resolved. Searched
    as every composition searches (csframework's configs, the ConfigStore); what the config reference lists."""
    with _session() as loader:
        sources = loader.get_sources()

        def load(path: str) -> Any:  # the first source on the search path that has it, as Hydra picks
            return next(source.load_config(path).config for source in sources if source.is_config(path))

        options = {group: {name: load(f"{group}/{name}") for name in loader.get_group_options(group)}
                   for group in groups}
        return load(config_name), options


def resolve_run_dir(cfg: DictConfig) -> str:
    """``hydra.run.dir`` resolved as a run does before anything else (with ``HydraConfig`` set, for
    ``${hydra:...}``), so that its interpolation errors are ``ConfigError``s naming it too."""
    from hydra.core.hydra_config import HydraConfig

    saved = HydraConfig.instance().cfg
    try:
        with composition_errors():
            HydraConfig.instance().set_config(cfg)
            return str(OmegaConf.select(cfg, "hydra.run.dir"))
    finally:
        HydraConfig.instance().cfg = saved


def plugin_choices(cfg: Any) -> tuple[list[str], list[str]]:
    """``plugins.enable`` and ``plugins.disable`` of a composed config (an element that is no string is left for
    typing to refuse, naming it)."""
    chosen = cfg.get("plugins") or {}
    enable, disable = ([p for p in chosen.get(key) or () if isinstance(p, str)] for key in ("enable", "disable"))
    return enable, disable


def plugins_of_config_files(overrides: Sequence[str], config_dir: str | None, config_name: str,
                            sections: Mapping[str, type] | None = None) -> tuple[list[str], list[str]] | None:
    """``plugin_choices`` of the config ``overrides`` compose, read where the strict composition failed: a
    config file (an experiment's, the primary config) may enable a plugin and set its section, which the
    schema of the plugins known so far (``sections``) refuses. Composed onto an open copy of the schema, with
    the overrides that choose config files or plugins (a setting of a section not yet known would be refused
    as an override); ``None`` when even that does not compose. The schema of ``sections`` is registered
    again afterwards."""
    from hydra.core.config_store import ConfigStore

    open_schema = OmegaConf.create(OmegaConf.to_container(cached_schema(sections, composing=True), enum_to_str=True))
    OmegaConf.set_struct(open_schema, False)
    ConfigStore.instance().store(name=SCHEMA_NAME, node=open_schema)
    choosing = [o for o in overrides
                if "." not in o.split("=", 1)[0] or o.lstrip("+~").startswith(("plugins.", "hydra."))]
    try:
        return plugin_choices(_compose(choosing, config_dir, config_name))
    except ConfigError:
        return None
    finally:
        register_schemas(sections)


def compose_dict(overrides: Sequence[str] = (), config_dir: str | None = None, config_name: str = "config", *,
                 config_files: Iterable[str] = (), sections: Mapping[str, type] | None = None,
                 disabled: Iterable[str] = ()) -> DictConfig:
    """The composed ``DictConfig`` (with the ``hydra`` node, its run directory checked), searching
    ``config_dir`` and then csframework's configs as the CLI's ``--config-dir`` does; ``disabled``: the
    disabled plugins, whose sections are gone (setting one says so). Raises ``ConfigError``."""
    register_schemas(sections)
    register_config_files(config_files)
    cfg = _compose(list(overrides), config_dir, config_name, sections=sections, disabled=disabled)
    resolve_run_dir(cfg)
    return cfg


def compose(overrides: Sequence[str] = (), config_dir: str | None = None, config_name: str = "config", *,
            backends: Mapping[str, type], config_files: Iterable[str] = (),
            sections: Mapping[str, type] | None = None, disabled: Iterable[str] = (),
            named: Mapping[str, tuple[str, type]] | None = None) -> RunConfig:
    """Compose the run config from Hydra overrides, and return the typed ``RunConfig``.

    ``config_dir`` adds a user config directory to the search path (like ``--config-dir``), before
    csframework's own, so it may also hold the primary config ``config_name``; ``config_files`` are the
    config directories of backend plugins (``register_config_files``); ``backends`` and ``sections`` as in
    ``config.to_run_config``; ``disabled``: the disabled plugins, whose sections are gone (setting one says
    so). Raises ``ConfigError`` naming the offending key. (``csf.compose`` is this with the plugins'
    contributions.)
    """
    overrides = list(overrides)
    cfg = compose_dict(overrides, config_dir, config_name, config_files=config_files, sections=sections,
                       disabled=disabled)
    return to_run_config(cfg, explicit_groups(overrides), backends=backends, sections=sections, named=named)
