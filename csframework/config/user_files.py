"""The user's config files: where they are, and the limits a file must keep before Hydra may read it."""
from __future__ import annotations

import os
import stat
from typing import Any, Iterable

from ..errors import ConfigError

#: A user's config file beyond these is refused before Hydra reads it: YAML aliases can expand a small
#: file exponentially (a "billion laughs" alias bomb), which would hang composition.
MAX_CONFIG_BYTES = 4 * 2**20
MAX_CONFIG_NODES = 100_000
#: ... and one nested deeper than this: Hydra reads YAML with PyYAML's recursive pure-Python parser, which
#: would fail with a RecursionError a few hundred levels down (no config nests more than a handful).
MAX_CONFIG_DEPTH = 100


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
                nbytes = _regular_file_size(path)
                if nbytes > MAX_CONFIG_BYTES:
                    raise ConfigError(f"{path}: {nbytes:,} bytes, larger than a config file "
                                      f"may be ({MAX_CONFIG_BYTES:,}); keep data out of config files")
                sizes: dict[int, int] = {}

                def size(node: Any, depth: int = 0) -> int:
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
                except OSError as e:
                    raise _unreadable(path, e) from None
                except RecursionError:
                    raise ConfigError(f"{path}: nested too deeply to be a config file (more than "
                                      f"{MAX_CONFIG_DEPTH} levels)") from None
                if total > MAX_CONFIG_NODES:
                    raise ConfigError(f"{path}: its YAML aliases expand it to more than {MAX_CONFIG_NODES:,} "
                                      "nodes (an alias bomb?); a config file must stay below that")


def _regular_file_size(path: str) -> int:
    """The size of the config file at ``path``; a ``ConfigError`` naming it when it cannot be read (a link
    to nothing, no permission) or is no regular file (a FIFO would block its read forever, a device
    never end)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise _unreadable(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: not a regular file, so no config file; remove it from the config directory")
    return st.st_size


def _unreadable(path: str, error: OSError) -> ConfigError:
    return ConfigError(f"{path}: cannot be read ({error.strerror or error}); fix or remove it (a config directory's "
                       "YAML files are all checked before Hydra reads any)")


def _compose_yaml(path: str, yaml: Any) -> Any:
    """The node graph of the YAML file at ``path``, by libyaml where PyYAML has it (fast). libyaml refuses
    nesting beyond its own limit as a syntax error; the pure-Python parser, which Hydra uses, then decides:
    a syntax error again (``YAMLError``), or a ``RecursionError``."""
    # opened without blocking and checked again by descriptor (swapped for a FIFO since the size was read, it
    # is refused, not waited on), and read no further than a config file may be
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path}: not a regular file, so no config file; remove it from the config directory")
        text = f.read(MAX_CONFIG_BYTES + 1)
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than a config file may be ({MAX_CONFIG_BYTES:,} bytes); keep data out of "
                          "config files")
    try:  # Hydra reads config files as UTF-8 (PyYAML alone would take UTF-16 too)
        text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {text[e.start:e.start + 1]!r}); save it as UTF-8"
                          ) from None
    try:
        return yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return yaml.compose(text, Loader=yaml.SafeLoader)
