"""Values OmegaConf takes for a schema's field but should not: a number for a boolean (``2`` and ``-1`` become
true), and a mapping or a list as an element of a list (or mapping) of plain values, which it keeps as it is
until something fails on it (``optimizer.weight_decay_exclude=[{a:1}]``). Checked on the composed values before
OmegaConf types them, for every section of the run (the plugins' too), every backend and every stage, each
problem one line naming the key (and the element's index)."""
from __future__ import annotations

import dataclasses
import enum
import functools
import reprlib
import typing
from typing import Any, Mapping

#: What each plain element type is called in the problem line.
_NAMES = {str: "strings", int: "integers", float: "numbers", bool: "true or false values"}

_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother = 40, 40  # a hostile value is shown, never at its full size


def loose_values(values: Any, schema: type, prefix: str = "") -> list[str]:
    """The problem lines for ``values`` (a plain mapping, as composed, interpolations not resolved) against the
    dataclass ``schema``: keys are ``prefix`` + the field's dotted path. A field ``values`` lacks, or typed
    ``Any``, is left alone (OmegaConf and the validation rules check the rest)."""
    if not isinstance(values, Mapping) or not dataclasses.is_dataclass(schema):
        return []
    hints = _field_types(schema)
    problems = []
    for name, kind in hints.items():
        if name in values:
            problems += _check(values[name], kind, f"{prefix}{name}")
    return problems


def _check(value: Any, kind: Any, key: str) -> list[str]:
    kind = _unwrap_optional(kind)
    if value is None or kind is Any:
        return []
    if kind is bool:
        return [f"{key}: {value!r} is a number, and it takes true or false"] if type(value) in (int, float) else []
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return loose_values(value, kind, key + ".")
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (list, tuple) and isinstance(value, list) and args:
        return [p for i, item in enumerate(value) for p in _element(item, args[0], f"{key}[{i}]", key)]
    if origin is dict and isinstance(value, Mapping) and len(args) == 2:
        return [p for name, item in value.items() for p in _element(item, args[1], f"{key}.{name}", key)]
    return []


def _element(item: Any, kind: Any, key: str, container: str) -> list[str]:
    """An element of a list or mapping field: a container where the field holds plain values is refused."""
    plain = _unwrap_optional(kind)
    name = _NAMES.get(plain) or (f"one of {', '.join(str(m.value) for m in plain)}"
                                 if isinstance(plain, type) and issubclass(plain, enum.Enum) else None)
    if name is not None and isinstance(item, (Mapping, list)):
        what = "a mapping" if isinstance(item, Mapping) else "a list"
        return [f"{key}: {_SHOWN.repr(item)} is {what}, and {container} holds {name}; "
                f"write each element as a plain value"]
    return _check(item, kind, key)


def _unwrap_optional(kind: Any) -> Any:
    """``X`` of ``Optional[X]`` (``Union[X, None]``); any other type as it is."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    return kind


@functools.lru_cache(maxsize=None)
def _field_types(schema: type) -> dict[str, Any]:
    """Each field's type, its annotation resolved (``from __future__ import annotations`` makes them strings);
    ``Any`` for one that does not resolve (a plugin's forward reference), which is then not checked."""
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # noqa: BLE001 - a plugin's annotation we cannot resolve: its fields go unchecked
        hints = {}
    return {f.name: hints.get(f.name, f.type if not isinstance(f.type, str) else Any)
            for f in dataclasses.fields(schema)}
