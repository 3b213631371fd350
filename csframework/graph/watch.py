"""``StateWatch``: the per-step check that a step's state is still the one ``tracer.collect_state`` collected.

Collecting the state (every module's parameters and buffers by name, the optimizers' state, the layout of
each tensor) is done once; each step only checks that nothing it depends on changed. What can change between
steps, and is compared here:

* by identity: every module's parameters, buffers and submodules (so a replaced or added parameter, buffer
  or layer), the optimizers' ``param_groups`` and ``state`` objects, the parameters of each group, each
  parameter's state entries (``exp_avg`` rebound by ``load_state_dict``, a new entry) and the extra state
  tensors (loss scaling);
* by value: each module's ``training`` flag, each state tensor's shape, dtype and ``requires_grad`` (a tensor
  changed in place, ``p.data = other`` or ``model.double()``, keeps its identity; a frozen parameter must
  leave the update), how many entries each of those containers holds, and every optimizer setting except the
  learning rate (a graph input).

The objects are gathered with C-level iteration (``map``, ``itertools.chain``), and compared with
``operator.is_``: a few microseconds a step where walking the same objects in Python took a hundred. The
watch keeps a reference to everything it compared, so no id is reused while it holds it.
"""
from __future__ import annotations

import operator
from itertools import chain
from typing import Any, Callable, Sequence

import torch

_PARAMETERS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
_CHILDREN = operator.attrgetter("_modules")
_TRAINING = operator.attrgetter("training")
_LAYOUT = [operator.attrgetter(name) for name in ("shape", "dtype", "requires_grad")]
_PARAMS = operator.itemgetter("params")
_VALUES = dict.values


def walk(module: torch.nn.Module, out: list) -> list:
    """``module`` and all its submodules, depth first (with repeats, as ``named_modules(remove_duplicate=False)``)."""
    out.append(module)
    for child in module._modules.values():
        if child is not None:
            walk(child, out)
    return out


def _plain(value: Any) -> bool:
    """Whether ``value`` compares by value safely (no tensor, whose ``==`` is elementwise)."""
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return value is None or isinstance(value, (bool, int, float, str))


def _getter(keys: Sequence) -> Callable[[dict], tuple]:
    """A C-level reader of ``keys`` from a dict, always returning a tuple."""
    if not keys:
        return lambda group: ()
    if len(keys) == 1:
        key = keys[0]
        return lambda group: (group[key],)
    return operator.itemgetter(*keys)


class StateWatch:
    """A snapshot of what the collected state depends on (see the module's docstring); ``unchanged()`` says
    whether it still holds. ``flags`` are the modules' ``training`` flags at the snapshot."""

    def __init__(self, modules: Sequence[torch.nn.Module], optimizers: Sequence, extras: Sequence[tuple],
                 tensors: Sequence[torch.Tensor]):
        self.modules = [m for module in modules for m in walk(module, [])]
        mods = self.modules  # torch never replaces these dicts of a module, only their entries
        self.dicts = [*map(_PARAMETERS, mods), *map(_BUFFERS, mods), *map(_CHILDREN, mods)]
        self.views = [d.values() for d in self.dicts]  # live views: made once
        self.optimizers = list(optimizers)
        self.extras = [(obj, attr) for obj, attr, _ in extras]
        self.tensors = list(tensors)
        # per group, the settings compared by value and those compared by identity (a tensor setting)
        self.settings: list[list[tuple[Callable, Callable]]] = []
        for opt in self.optimizers:
            per_group = []
            for group in opt.param_groups:
                keys = sorted((k for k in group if k not in ("params", "lr")), key=str)
                per_group.append((_getter([k for k in keys if _plain(group[k])]),
                                  _getter([k for k in keys if not _plain(group[k])])))
            self.settings.append(per_group)
        self.flags = tuple(map(_TRAINING, self.modules))
        self.snapshot = self._take()

    def _take(self) -> tuple[list, list]:
        """(objects compared by identity, values compared by ``==``)."""
        objects = [*chain.from_iterable(self.views)]
        values: list = [*map(len, self.dicts), *map(_TRAINING, self.modules)]
        for part in _LAYOUT:
            values += map(part, self.tensors)
        for opt, per_group in zip(self.optimizers, self.settings):
            groups, state = opt.param_groups, opt.state
            objects += (groups, state, *chain.from_iterable(map(_PARAMS, groups)), *state)
            entries = list(state.values())
            objects += chain.from_iterable(map(_VALUES, entries))
            values += (len(groups), *map(len, map(_PARAMS, groups)), *map(len, groups), *map(len, entries))
            for (by_value, by_identity), group in zip(per_group, groups):
                settings = by_value(group)
                values += (tuple(map(type, settings)), settings)  # types first: a tensor never meets ``==``
                objects += by_identity(group)
        objects += (getattr(obj, attr) for obj, attr in self.extras)
        return objects, values

    def unchanged(self) -> bool:
        """Whether everything the snapshot holds is still the same (a removed setting or state counts as a
        change)."""
        old_objects, old_values = self.snapshot
        try:
            objects, values = self._take()
            return (len(objects) == len(old_objects) and all(map(operator.is_, objects, old_objects))
                    and values == old_values)
        except (KeyError, AttributeError, TypeError, RuntimeError):  # e.g. a state entry that is no dict
            return False
