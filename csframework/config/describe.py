"""Error prose: one line for a composition error, naming the key, override, config group or file."""
from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
from typing import Any, Collection, Iterable, Mapping, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException


def describe_error(error: BaseException, prefix: str = "") -> str:
    """One line for a composition error, naming the full key where OmegaConf knows it (or the override,
    the config group or the file); ``prefix`` is the path of the node the error is relative to
    (``stages.<name>.``). An unknown key gets the nearest known one ("did you mean"); a key of an open
    map that does not exist (``stages.b.loop.max_steps=3`` without a stage ``b``) gets Hydra's ``+`` form."""
    append = re.search(r"To append to your config use (.+)", str(error))  # the override, spaces and all
    seen: BaseException | None = error
    while seen is not None:
        found = _describe_known(seen)
        if found:
            return found
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            msg = str(getattr(seen, "msg", None) or seen).splitlines()[0]
            key = prefix + str(seen.full_key)
            if append and getattr(seen, "object_type", None) is dict:
                add = f"write {shlex.quote(append.group(1))}"  # as pasted into a shell
                parent, name = getattr(seen, "parent_node", None), getattr(seen, "key", None)
                close = None
                if isinstance(parent, DictConfig) and isinstance(name, str):
                    close = closest(name, [str(k) for k in parent])
                if close and isinstance(name, str):  # a misspelt argument of a model or dataset (no schema's)
                    return (f"{key}: not in the config; did you mean `{key[:len(key) - len(name)]}{close}`? "
                            f"(to add a new key, {add})")
                return f"{key}: not in the config; to add it, {add}"
            hint = next((h for text, h in _INTERPOLATION_HINTS.items() if text in msg), "")
            return f"{key}: {msg}{hint}{_did_you_mean(seen, key)}"
        seen = seen.__cause__ or seen.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return prefix + (" ".join(lines[:3]) if lines else type(error).__name__)


def closest(word: str, options: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The option closest to ``word`` ("did you mean"), if one is close enough (``difflib``'s measure, at least
    ``cutoff``)."""
    close = difflib.get_close_matches(word, [o for o in options if o != word], n=1, cutoff=cutoff)
    return close[0] if close else None


def _did_you_mean(error: OmegaConfBaseException, key: str) -> str:
    """``; did you mean `loop.max_steps`?`` for an unknown key of a schema, when one is close enough."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    schema = getattr(error, "object_type", None)
    name = getattr(error, "key", None)
    if not (isinstance(error, (ConfigAttributeError, ConfigKeyError)) and dataclasses.is_dataclass(schema)
            and isinstance(name, str) and key.endswith(name)):
        return ""
    close = closest(name, [f.name for f in dataclasses.fields(schema)])
    return f"; did you mean `{key[:len(key) - len(name)]}{close}`?" if close else ""


def describe_missing_interpolation(error: BaseException, cfg: DictConfig, choices: Mapping[str, Any],
                                   overridden: Collection[str] = ()) -> str | None:
    """One line for an interpolation whose key is not there, naming the group options involved: a group
    option that interpolates into another group (``data.train.block_size: ${model.block_size}``), composed
    with an option of that group that lacks the key (a model of the user's own), reads
    ``data.train.block_size: ${model.block_size} (from data=my_text) but model=my_model has no block_size;
    set data.train.block_size=<value> ...``. ``cfg``: the composed config (its values unresolved);
    ``choices``: Hydra's group choices (``hydra.runtime.choices``); ``overridden``: the keys the overrides
    set (an interpolation given there comes from the command line). ``None`` for any other error."""
    seen: BaseException | None = error
    while seen is not None and not isinstance(seen, InterpolationKeyError):
        seen = seen.__cause__ or seen.__context__
    key = str(getattr(seen, "full_key", None) or "")
    wanted = re.search(r"Interpolation key '([^']+)' not found", str(getattr(seen, "msg", None) or seen))
    if seen is None or not key or wanted is None:
        return None
    target = wanted.group(1)
    group = key.split(".", 1)[0]
    source = (" (from the overrides)" if key in overridden else
              f" (from {group}={choices[group]})" if group in choices else "")
    other, _, missing = target.partition(".")
    if other in choices and missing:
        lacking, instead = f"{other}={choices[other]} has no {missing}", f", or choose a {other} that has one"
    else:
        lacking, instead = f"the config has no {target}", ""
    raw = _unresolved(cfg, key) or "${" + target + "}"
    return f"{key}: {raw}{source} but {lacking}; set {key}=<value>{instead}"


def _unresolved(cfg: DictConfig, key: str) -> str | None:
    """The value of ``key`` in ``cfg`` as written (``${model.block_size}``), if a plain dotted key leads there."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if "[" in key or not isinstance(node, DictConfig):  # (an item of a list: not a plain dotted key)
        return None
    value = cast("dict[str, Any]", OmegaConf.to_container(node, resolve=False)).get(name)
    return value if isinstance(value, str) else None


#: What to do about OmegaConf's interpolation errors, found by their message.
_INTERPOLATION_HINTS = {
    "Recursive interpolation": "; the interpolations refer to each other in a cycle: give one of them a value",
    "Environment variable": "; set it, or give a default: ${oc.env:NAME,default}",
    "Unsupported interpolation type": ": no resolver of that name is registered; check its spelling "
                                      "(e.g. ${oc.env:NAME})",
}


def _found_nearby(group: str, option: str) -> str:
    """Where the working directory holds a file for ``group=option`` that the search path missed (its config
    directory not given with ``--config-dir``; the file in another folder than the group's): the hint, else ''."""
    from pathlib import Path

    files = sorted(p for pattern in (f"{group}/{option}.yaml", f"*/{group}/{option}.yaml", f"*/{option}.yaml",
                                     f"*/*/{option}.yaml") for p in Path().glob(pattern) if p.is_file())
    for path in files:
        if path.parent.as_posix().endswith(group):
            base = path.parent.as_posix()[: -len(group)].rstrip("/") or "."
            return f"; {path} is here: give its config directory with --config-dir {base}"
    if files:
        return (f"; {files[0]} is here, but a config group's options are the files of a folder named after it: "
                f"move it to <your config directory>/{group}/")
    return ""


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
            close = closest(option, error.options)
            hint = f"; did you mean `{group}={close}`?" if close else _found_nearby(group, option)
            return (f"{group.replace('/', '.')}: no option '{option}' in config group '{group}' "
                    f"(available: {', '.join(error.options) or 'none'}){hint}")
        first = str(error).splitlines()[0].strip()
        return f"{missing or 'config'}: {first}" if missing and missing not in first else first
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return (f"{mark.name}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: "
                f"{error.problem or error.context}")
    if isinstance(error, yaml.YAMLError):
        return f"invalid YAML: {str(error).splitlines()[0]}"
    return None
