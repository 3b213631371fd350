"""Where a config key was set, for an error that names the user's setting: the command line, or the config
file (a group option such as ``conf/model/my_model.yaml``, or the primary config) that holds it. Read from
Hydra's record of the running job; ``None`` outside Hydra (a config composed from Python)."""
from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import yaml

#: A config file bigger than this is not read here (``check_config_files`` refused any over 4 MiB already).
MAX_FILE_BYTES = 4 << 20


def where_set(key: str) -> str | Path | None:
    """``on the command line (model.hiden=16)``, the config file that sets ``key`` (``conf/model/my_model.yaml``),
    or ``None`` when Hydra is not running a job or no file is found to hold it."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    for override in hydra.overrides.task:
        if str(override).split("=", 1)[0].lstrip("+~") == key:
            return f"on the command line ({override})"
    group, _, rest = key.partition(".")
    option = hydra.runtime.choices.get(group)
    candidates = ([(f"{group}/{option}.yaml", rest)] if option else []) + [(f"{hydra.job.config_name}.yaml", key)]
    for name, path in candidates:
        for directory in _source_dirs(hydra.runtime.config_sources):
            file = directory / name
            if file.is_file() and _holds(file, path):
                return file
    return None


def _source_dirs(sources: Any) -> list[Path]:
    """The directories of the config search path, the user's (``file://``) before packages' (``pkg://``)."""
    found = []
    for source in sorted(sources, key=lambda s: s.schema != "file"):
        try:
            if source.schema == "file":
                found.append(Path(source.path))
            elif source.schema == "pkg" and source.path:
                found.append(Path(str(importlib.resources.files(source.path))))
        except (ModuleNotFoundError, TypeError, ValueError):
            continue
    return found


def _holds(file: Path, dotted: str) -> bool:
    """Whether the YAML ``file`` (read bounded; unreadable: no) sets the dotted key ``dotted``."""
    try:
        if file.stat().st_size > MAX_FILE_BYTES:
            return False
        node = yaml.safe_load(file.read_text())
    except (OSError, ValueError, yaml.YAMLError, RecursionError):
        return False
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
