"""A data setting's ``collate_fn``: built from its ``_target_`` (``build_collate``) and checked on every
batch it makes (``CheckedCollate``)."""
from __future__ import annotations

import functools
from typing import Any

from .config import plain
from .errors import ConfigError, DataError


def build_collate(spec: Any, key: str = "data.collate_fn"):
    """The ``collate_fn`` of ``spec`` (``None``: torch's default): a ``_target_`` naming a function (the other
    keys are bound as keyword arguments) or a class (built with them; its instances are called)."""
    if spec is None:
        return None
    from .targets import build, find_target

    spec = {"_target_": spec} if isinstance(spec, str) else plain(spec)
    target = spec.pop("_target_", None)
    found = find_target(target, f"{key}._target_")
    made = build({"_target_": target, **spec}, key) if isinstance(found, type) else (
        functools.partial(found, **spec) if spec else found)
    if not callable(made):
        raise ConfigError(f"{key}: '{target}' built a {type(made).__name__}, which is not callable")
    return made


class CheckedCollate:
    """A user's ``collate_fn`` whose every result is checked: ``None`` is no batch (the model would fail on
    it far from the cause), refused naming the function and ``role`` (``data.train``)."""

    def __init__(self, collate, role: str):
        self.collate, self.role = collate, role

    def __call__(self, samples):
        batch = self.collate(samples)
        if batch is None:
            raise DataError(f"{self.role}: data.collate_fn ({callable_name(self.collate)}) returned None for "
                            f"{len(samples)} samples; it must return the batch (tensors, or a list, tuple or dict "
                            "of them)")
        return batch


def callable_name(fn) -> str:
    """``module.function`` of a function, a ``functools.partial`` of one, or a callable object's class."""
    fn = fn.func if isinstance(fn, functools.partial) else fn
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"
