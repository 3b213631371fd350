"""Strict JSON for everything csframework writes (``summary.json``, ``events.jsonl``, ``sweep.json``,
checkpoint metadata): any standard JSON parser reads it.

- A float that is not finite is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (the
  names Python's ``float()`` and JavaScript's ``Number()`` read back), never as a bare token.
- NumPy and torch scalars are written as numbers, paths as strings, enums as their values, tuples as lists.
- Any other value is an error naming where it is (``metrics.acc: a Foo cannot be written as JSON``), never
  its ``repr``.
"""
from __future__ import annotations

import enum
import json
import math
import numbers
import os
from typing import Any

NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else NON_FINITE[value]


def jsonable(value: Any, where: str = "value") -> Any:
    """``value`` as plain JSON data (see the module's rules); ``TypeError`` naming ``where`` otherwise."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int) and not isinstance(value, enum.Enum):
        return int(value)
    if isinstance(value, float):
        return _float(float(value))
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise TypeError(f"{where}: a key of type {type(key).__name__} cannot be written as JSON")
            kind = type(item)  # an event's fields: plain strings, ints and finite floats kept as they are
            out[key if isinstance(key, str) else str(key)] = item if kind is str or kind is int or (
                kind is float and math.isfinite(item)) else jsonable(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, enum.Enum):
        return jsonable(value.value, where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # a NumPy scalar or a 0-d tensor
        return jsonable(value.item(), where)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return _float(float(value))
    raise TypeError(f"{where}: a {type(value).__name__} cannot be written as JSON; give a number, string, "
                    "list or mapping")


class JsonDict(dict):
    """A dict whose values are checked to be JSON data (``jsonable``) as they are set: a value JSON cannot hold
    is a ``TypeError`` naming its key where it is set, so the plugin that set it is the one blamed, not the
    one that writes the file later. (A value changed inside a nested container is checked when written.)"""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def __setitem__(self, key, value) -> None:
        jsonable({key: value}, self.where)
        super().__setitem__(key, value)

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


#: The key and value types of a flat event that ``jsonable`` returns as they are (a finite float included).
_PLAIN_KEYS, _PLAIN_FIELDS = frozenset((str,)), frozenset((str, int, float))
#: The encoder of those flat dicts, made once (``json.dumps`` with any option makes a new one per call); a
#: flat dict holds no container, so there is no cycle to check.
_FLAT = json.JSONEncoder(allow_nan=False, ensure_ascii=False, check_circular=False)


def _c_encoder(encoder: json.JSONEncoder) -> Any:
    """The C encoder ``encoder.encode`` makes at every call (``JSONEncoder.iterencode``: about 80 bytecodes
    an event), made once with the same settings; ``None`` where ``json`` has no C encoder or makes it
    otherwise (then ``encoder.encode`` is used)."""
    try:
        return json.encoder.c_make_encoder(  # type: ignore[attr-defined]
            markers=None, default=encoder.default, encoder=json.encoder.encode_basestring,
            indent=None, key_separator=encoder.key_separator, item_separator=encoder.item_separator,
            sort_keys=False, skipkeys=False, allow_nan=False)
    except (AttributeError, TypeError):  # no C module (None is not callable), other arguments
        return None


#: ``_FLAT_CHUNKS(value, 0)``: a flat dict's JSON text in pieces (the C encoder's, or else ``_FLAT.encode``'s)
_FLAT_CHUNKS = _c_encoder(_FLAT) or (lambda value, _level: (_FLAT.encode(value),))


def dumps(value: Any, indent: int | None = None, where: str = "value") -> str:
    """``value`` as strict JSON text (``jsonable``)."""
    if indent is None and type(value) is dict and _PLAIN_KEYS.issuperset(map(type, value)) \
            and _PLAIN_FIELDS.issuperset(map(type, value.values())):
        # a flat dict of plain fields (an event, a log's metrics): jsonable would return it as it is unless a
        # float is not finite, which json refuses (ValueError): then it is converted; checked in C, not walked
        try:
            return "".join(_FLAT_CHUNKS(value, 0))
        except ValueError:
            pass
    return json.dumps(jsonable(value, where), indent=indent, allow_nan=False, ensure_ascii=False)
