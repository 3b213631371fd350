"""A step's arguments flattened, and its outputs rebuilt, at every execution without torch's general pytree.

``torch.utils._pytree`` handles any registered container, at some microseconds per node in Python: on a small
model that was a tenth of the emulator's own work per step. Steps take and return plain tuples, lists and
dicts of tensors; those are handled here directly, in the very order and shape pytree gives (anything else,
a named tuple or an ``OrderedDict`` say, is handed to pytree).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

#: Types that are always pytree leaves, taken as they are.
_LEAVES = frozenset({torch.Tensor, int, float, bool, str, type(None)})


def leaves(tree: Any) -> list:
    """``pytree.tree_leaves(tree)``, faster for plain tuples, lists and dicts."""
    out: list = []
    _collect(tree, out)
    return out


def _collect(tree: Any, out: list) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            _collect(item, out)
    elif kind is dict:
        for item in tree.values():
            _collect(item, out)
    elif kind in _LEAVES:
        out.append(tree)
    else:
        out.extend(pytree.tree_leaves(tree))


Builder = Callable[[Iterator], Any]

#: Builders by ``id`` of their spec (kept with the spec, so that no other spec takes its id meanwhile).
_BUILDERS: dict[int, tuple[pytree.TreeSpec, Builder]] = {}
_MAX_BUILDERS = 256  # a retrace records new specs at every step: the oldest are dropped


def unflatten(values: list, spec: pytree.TreeSpec) -> Any:
    """``pytree.tree_unflatten(values, spec)``: a builder made once per spec rebuilds plain containers."""
    known = _BUILDERS.get(id(spec))
    if known is None or known[0] is not spec:
        if len(_BUILDERS) >= _MAX_BUILDERS:
            del _BUILDERS[next(iter(_BUILDERS))]
        known = _BUILDERS[id(spec)] = (spec, _builder(spec))
    if len(values) != spec.num_leaves:
        raise ValueError(f"{len(values)} values for a structure of {spec.num_leaves} leaves")
    return known[1](iter(values))


def _children(spec: pytree.TreeSpec) -> list:
    children = getattr(spec, "children", None)  # torch >= 2.9; ``children_specs`` before (now deprecated)
    return list(children()) if callable(children) else list(spec.children_specs)


def _builder(spec: pytree.TreeSpec) -> Builder:
    if spec.is_leaf():
        return next
    kind = spec.type
    parts = [_builder(child) for child in _children(spec)]
    if kind is tuple:
        return lambda it: tuple([part(it) for part in parts])
    if kind is list:
        return lambda it: [part(it) for part in parts]
    if kind is dict:
        keys = list(spec.context)
        return lambda it: dict(zip(keys, [part(it) for part in parts]))
    n = spec.num_leaves
    return lambda it: spec.unflatten([next(it) for _ in range(n)])
