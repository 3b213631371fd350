"""Error prose: one line for a composition error, naming the key, override, config group or file."""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Iterable

from omegaconf.errors import OmegaConfBaseException


def describe_error(error: BaseException, prefix: str = "") -> str:
    """One line for a composition error, naming the full key where OmegaConf knows it (or the override,
    the config group or the file); ``prefix`` is the path of the node the error is relative to
    (``stages.<name>.``). An unknown key gets the nearest known one ("did you mean"); a key of an open
    map that does not exist (``stages.b.loop.max_steps=3`` without a stage ``b``) gets Hydra's ``+`` form."""
    append = re.search(r"To append to your config use (\S+)", str(error))
    seen: BaseException | None = error
    while seen is not None:
        found = _describe_known(seen)
        if found:
            return found
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            msg = str(getattr(seen, "msg", None) or seen).splitlines()[0]
            key = prefix + str(seen.full_key)
            if append and getattr(seen, "object_type", None) is dict:
                return f"{key}: not in the config; to add it, write {append.group(1)}"
            hint = next((h for text, h in _INTERPOLATION_HINTS.items() if text in msg), "")
            return f"{key}: {msg}{hint}{_did_you_mean(seen, key)}"
        seen = seen.__cause__ or seen.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return prefix + (" ".join(lines[:3]) if lines else type(error).__name__)


def closest(word: str, options: Iterable[str]) -> str | None:
    """The option closest to ``word`` ("did you mean"), if one is close enough (``difflib``'s measure)."""
    close = difflib.get_close_matches(word, [o for o in options if o != word], n=1)
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


#: What to do about OmegaConf's interpolation errors, found by their message.
_INTERPOLATION_HINTS = {
    "Recursive interpolation": "; the interpolations refer to each other in a cycle: give one of them a value",
    "Environment variable": "; set it, or give a default: ${oc.env:NAME,default}",
    "Unsupported interpolation type": ": no resolver of that name is registered; check its spelling "
                                      "(e.g. ${oc.env:NAME})",
}


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
            hint = f"; did you mean `{group.replace('/', '.')}={close}`?" if close else ""
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
