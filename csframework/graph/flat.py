"""A step's arguments flattened, and its outputs rebuilt, at every execution without torch's general pytree.

``torch.utils._pytree`` handles any registered container, at some microseconds per node in Python: on a small
model that was a tenth of the emulator's own work per step. Steps take and return plain tuples, lists and
dicts of tensors; those are handled here directly, in the very order and shape pytree gives (anything else,
a named tuple or an ``OrderedDict`` say, is handed to pytree), the outputs by code generated once per
structure (``_builder``), a step's arguments by code generated for the last call's structure (``flattener``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

#: Types that are always pytree leaves, taken as they are.
_LEAVES = frozenset({torch.Tensor, int, float, bool, str, type(None)})


def leaves(tree: Any) -> list:
    """``pytree.tree_leaves(tree)``, faster for plain tuples, lists and dicts."""
    out: list = []
    _collect(tree, out)
    return out


def call_leaves(args: tuple, kwargs: dict) -> list:
    """``leaves((args, kwargs))``: a call's arguments, one container fewer to walk."""
    out: list = []
    _collect(args, out)
    if kwargs:
        _collect(kwargs, out)
    return out


Flattener = Callable[[tuple, dict], "list | None"]


def flattener(args: tuple, kwargs: dict) -> Flattener:
    """A function of a call's ``(args, kwargs)`` that returns ``call_leaves(args, kwargs)`` when they have the
    structure of these (the same container types, lengths and dict keys in order, a leaf of a leaf type where
    these have one), else ``None``: one generated expression, where ``_collect`` makes a call per container.
    For a structure with another node, or a large or deep one, ``call_leaves`` itself."""
    checks: list[str] = []
    found: list[str] = []
    keys: list[tuple] = []

    def walk(expr: str, node: Any, depth: int) -> bool:
        kind = type(node)
        name = f"v{len(checks)}"  # each node read once, into a local of the generated function
        if kind in _LEAVES:
            checks.append(f"type({name} := {expr}) in L")
            found.append(name)
            return True
        if depth >= _MAX_DEPTH or len(found) > _MAX_FLAT_LEAVES:
            return False
        if kind is dict:  # its keys are constants (``K``), never written into the code
            keys.append(tuple(node))
            known = f"K[{len(keys) - 1}]"
            checks.append(f"type({name} := {expr}) is dict and tuple({name}) == {known}")
            return all(walk(f"{name}[{known}[{i}]]", value, depth + 1) for i, value in enumerate(node.values()))
        if kind is tuple or kind is list:
            checks.append(f"type({name} := {expr}) is {kind.__name__} and len({name}) == {len(node)}")
            return all(walk(f"{name}[{i}]", item, depth + 1) for i, item in enumerate(node))
        return False

    if not (walk("a", args, 0) and walk("k", kwargs, 0)):
        return call_leaves
    code = f"lambda a, k: [{', '.join(found)}] if {' and '.join(checks)} else None"
    return eval(code, {"L": _LEAVES, "K": keys})  # noqa: S307 - indices and names only


def _collect(tree: Any, out: list) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        items = tree
    elif kind is dict:
        items = tree.values()
    elif kind in _LEAVES:
        out.append(tree)
        return
    else:
        out.extend(pytree.tree_leaves(tree))
        return
    for item in items:
        if type(item) in _LEAVES:  # a leaf taken here: no call for it
            out.append(item)
        else:
            _collect(item, out)


Builder = Callable[[Sequence], Any]

#: Builders by ``id`` of their spec (kept with the spec, so that no other spec takes its id meanwhile).
_BUILDERS: dict[int, tuple[pytree.TreeSpec, Builder]] = {}
_MAX_BUILDERS = 256  # a retrace records new specs at every step: the oldest are dropped
#: Builders by spec (equal specs share one: generating a builder takes some tens of microseconds).
_BY_STRUCTURE: dict[pytree.TreeSpec, Builder] = {}
_MAX_DEPTH = 50  # deeper plain containers are rebuilt by pytree (Python's parser limits nesting to 200)
_MAX_LEAVES = 10_000  # a larger structure is rebuilt by pytree (its generated code would be long to compile)
_MAX_FLAT_LEAVES = 1_000  # a call's arguments with more leaves are walked (``flattener``)


def unflatten(values: Sequence, spec: pytree.TreeSpec) -> Any:
    """``pytree.tree_unflatten(values, spec)``: a builder made once per spec rebuilds plain containers."""
    if len(values) != spec.num_leaves:
        raise ValueError(f"{len(values)} values for a structure of {spec.num_leaves} leaves")
    return builder(spec)(values)


def builder(spec: pytree.TreeSpec) -> Builder:
    """The function that rebuilds ``spec``'s structure from exactly ``spec.num_leaves`` values (made once per
    spec: ``_BUILDERS``)."""
    known = _BUILDERS.get(id(spec))
    if known is None or known[0] is not spec:
        if len(_BUILDERS) >= _MAX_BUILDERS:
            del _BUILDERS[next(iter(_BUILDERS))]
        known = _BUILDERS[id(spec)] = (spec, _same_structure(spec))
    return known[1]


def _same_structure(spec: pytree.TreeSpec) -> Builder:
    """The builder of an equal spec made before (a retrace records its specs anew at every step), else a new one."""
    try:
        builder = _BY_STRUCTURE.get(spec)
    except TypeError:  # a spec that cannot be hashed (a context that is not)
        return _builder(spec)
    if builder is None:
        if len(_BY_STRUCTURE) >= _MAX_BUILDERS:
            del _BY_STRUCTURE[next(iter(_BY_STRUCTURE))]
        builder = _BY_STRUCTURE[spec] = _builder(spec)
    return builder


def _children(spec: pytree.TreeSpec) -> list:
    children = getattr(spec, "children", None)  # torch >= 2.9; ``children_specs`` before (now deprecated)
    return list(children()) if callable(children) else list(spec.children_specs)


def _builder(spec: pytree.TreeSpec) -> Builder:
    """A function of the leaves ``v`` that rebuilds ``spec``'s structure in one expression, generated once per
    spec: a tuple, list or dict display for each plain container (the dict's keys taken from ``spec``, never
    written into the code), ``pytree`` for any other node. A step's outputs are then rebuilt in one call
    where a function per container took some microseconds."""
    if spec.num_leaves > _MAX_LEAVES:
        return spec.unflatten
    constants: list = []
    count = 0

    def expression(node: pytree.TreeSpec, depth: int) -> str:
        nonlocal count
        if node.is_leaf():
            count += 1
            return f"v[{count - 1}]"
        kind = node.type
        if kind in (tuple, list, dict) and depth < _MAX_DEPTH:
            parts = [expression(child, depth + 1) for child in _children(node)]
            if kind is tuple:
                return "(" + "".join(f"{part}, " for part in parts) + ")"
            if kind is list:
                return "[" + ", ".join(parts) + "]"
            constants.append(tuple(node.context))
            keys = f"c[{len(constants) - 1}]"
            return "{" + ", ".join(f"{keys}[{j}]: {part}" for j, part in enumerate(parts)) + "}"
        constants.append(node)
        start, count = count, count + node.num_leaves
        return f"c[{len(constants) - 1}].unflatten(v[{start}:{count}])"

    return eval(f"lambda v: {expression(spec, 0)}", {"c": constants})  # noqa: S307 - indices and names only
