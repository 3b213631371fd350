"""``StateWatch``: the per-step check that a step's state is still the one ``tracer.collect_state`` collected.

Collecting the state (every module's parameters and buffers by name, the optimizers' state, the layout of
each tensor) is done once; each step only checks that nothing it depends on changed. What can change between
steps, and is compared here:

* by identity: the modules and optimizers given (lists the caller may change: ``csf.trace`` adds an
  optimizer registered later), every module's parameters, buffers, submodules and ``training`` flag (so a
  replaced or added parameter, buffer or layer, a module put in evaluation mode), the optimizers'
  ``param_groups`` list, its
  group dicts and ``state`` objects, the parameters of each group, each parameter's state entries
  (``exp_avg`` rebound by ``load_state_dict``, a new entry), every optimizer setting except the learning
  rate (a graph input) and the extra state tensors (loss scaling). A setting rebound to an equal value
  fails the check; the caller then collects the state again and compares its signature, by value;
* by value: how many entries each of those containers holds;
* by layout (``layout_check``): each state tensor's shape, dtype, device and ``requires_grad`` (a tensor
  changed in place, ``p.data = other`` or ``model.double()``, keeps its identity; a frozen parameter must
  leave the update).

Where torch's guard manager can be used, all of it, and the layouts of the step's arguments, are compared by
it in one C call a step (``check``, ``state_guard.py``); elsewhere (and in ``unchanged``, the slow path) the
objects are gathered with C-level iteration (``map``, ``itertools.chain``) and compared with ``operator.is_``,
and the layouts in C by torch's own tensor guard where this torch has it: a few microseconds a step where
walking the same objects in Python took a hundred. The watch keeps a reference to everything it compared, so
no id is reused while it holds it.
"""
from __future__ import annotations

import operator
from itertools import chain
from typing import Any, Callable, Sequence

import torch

from .state_guard import state_guard

_PARAMETERS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
_CHILDREN = operator.attrgetter("_modules")
_TRAINING = operator.attrgetter("training")
_LAYOUT = operator.attrgetter("shape", "dtype", "device", "requires_grad")
_PARAMS = operator.itemgetter("params")
_PARAM_GROUPS = operator.attrgetter("param_groups")
_STATE = operator.attrgetter("state")
_LR = operator.itemgetter("lr")
_VALUES = dict.values
_CALL = getattr(operator, "call", lambda fn, *args: fn(*args))  # operator.call: Python 3.11
_ARG_LAYOUT = operator.attrgetter("__class__", "shape", "dtype", "device", "requires_grad")
_MAX_GUARDS = 8  # arguments' layouts a watch keeps a guard for
_MAX_REBUILDS = 4  # guards a watch builds again for a dict written without a change, before it stops


def walk(module: torch.nn.Module, out: list) -> list:
    """``module`` and all its submodules, depth first (with repeats, as ``named_modules(remove_duplicate=False)``)."""
    out.append(module)
    for child in module._modules.values():
        if child is not None:
            walk(child, out)
    return out


def _getter(keys: Sequence) -> Callable[[dict], tuple]:
    """A C-level reader of ``keys`` from a dict, always returning a tuple."""
    if not keys:
        return lambda group: ()
    if len(keys) == 1:
        key = keys[0]
        return lambda group: (group[key],)
    return operator.itemgetter(*keys)


def layout_check(tensors: Sequence[torch.Tensor]) -> Callable[..., bool]:
    """A check, called with tensors unpacked, that they have the shapes, dtypes, devices and ``requires_grad``
    of ``tensors`` now. torch's C tensor guard (``TensorGuards``, which also compares the tensor's type and
    dispatch keys, strides left out) takes about a microsecond for 16 tensors, a quarter of reading the
    attributes in Python; where this torch lacks it, or it does not pass the very tensors it was made
    from, the attributes are compared."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        strides: Any = [[None] * t.dim() for t in tensors]  # per tensor, per dimension: not compared
        guards = TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=strides)
        if guards.check(*tensors):
            return guards.check
    except Exception:  # noqa: BLE001 - a private API: any change of it leaves the plain comparison
        pass
    types, layout = list(map(type, tensors)), list(map(_LAYOUT, tensors))

    def attributes_match(*now) -> bool:
        return list(map(type, now)) == types and list(map(_LAYOUT, now)) == layout  # types first: a non-tensor

    return attributes_match


class StateWatch:
    """A snapshot of what the collected state depends on (see the module's docstring); ``unchanged()`` says
    whether it still holds. ``flags`` are the modules' ``training`` flags at the snapshot."""

    def __init__(self, modules: Sequence[torch.nn.Module], optimizers: Sequence, extras: Sequence[tuple],
                 tensors: Sequence[torch.Tensor]):
        self.given = (modules, optimizers)  # the caller's lists, live (csf.trace's steps update them in place)
        self.modules = [m for module in modules for m in walk(module, [])]
        mods = self.modules  # torch never replaces these dicts of a module, only their entries
        self.dicts = [*map(_PARAMETERS, mods), *map(_BUFFERS, mods), *map(_CHILDREN, mods)]
        self.views = [d.values() for d in self.dicts]  # live views: made once
        self.optimizers = list(optimizers)
        self.groups = [group for opt in self.optimizers for group in opt.param_groups]
        self.extras = ([obj for obj, _, _ in extras], [attr for _, attr, _ in extras])  # (objects, names)
        self.tensors = list(tensors)
        self.layout = layout_check(self.tensors)
        # per group: the reader of its settings but the parameters and the learning rate
        self.settings = [_getter(sorted((k for k in group if k not in ("params", "lr")), key=str))
                         for group in self.groups]
        self.flags = tuple(map(_TRAINING, self.modules))
        self.snapshot = self._take()  # also the references that keep the guard's ids from being reused
        self.guards: dict[tuple, Callable[[Sequence], bool] | None] = {}  # by arguments' layout (``check``)
        self.rebuilds = 0  # guards built again, the state unchanged

    def _take(self) -> tuple[list, list]:
        """(objects compared by identity, lengths compared by ``==``). The group dicts are the snapshot's
        (``self.groups``) for their parameters and settings: if any was replaced, or one added, the objects
        differ already, at the group."""
        groups, states = self.groups, list(map(_STATE, self.optimizers))
        group_lists = list(map(_PARAM_GROUPS, self.optimizers))
        entries = list(chain.from_iterable(map(_VALUES, states)))
        objects = [*chain.from_iterable(self.given), *chain.from_iterable(self.views),
                   *map(_TRAINING, self.modules), *group_lists, *chain.from_iterable(group_lists), *states,
                   *chain.from_iterable(states),
                   *chain.from_iterable(map(_PARAMS, groups)), *chain.from_iterable(map(_VALUES, entries)),
                   *chain.from_iterable(map(_CALL, self.settings, groups)), *map(getattr, *self.extras)]
        values = [*map(len, self.dicts), *map(len, group_lists), *map(len, map(_PARAMS, groups)),
                  *map(len, groups), *map(len, entries)]
        return objects, values

    def unchanged(self) -> bool:
        """Whether everything the snapshot holds is still the same (a removed setting or state counts as a
        change)."""
        old_objects, old_values = self.snapshot
        try:
            objects, values = self._take()
            return (len(objects) == len(old_objects) and all(map(operator.is_, objects, old_objects))
                    and values == old_values and self.layout(*self.tensors))
        except (KeyError, AttributeError, TypeError, RuntimeError):  # e.g. a state entry that is no dict
            return False

    def check(self, leaves: Sequence) -> Callable[[Sequence], bool]:
        """A check, called with a step's flattened arguments, that the state is ``unchanged()`` and that they have
        the types and layouts of ``leaves``: torch's guard manager in one C call (``state_guard.py``) where it
        can be used and all of them are tensors, else ``unchanged()`` and ``args_check`` (never true where an
        argument is no tensor: the signature is then computed anew)."""
        fits = args_check(leaves)
        if fits is None:
            return lambda now: False
        # one guard per arguments' layout (an evaluation's last batch may be short): built in milliseconds; built
        # again where a dict was written without a change (a trace swaps the parameters out and back), but not
        # at every step (a user's ``preinitialize()`` that writes its state each time): then compared in Python
        layout = tuple(map(_ARG_LAYOUT, leaves))
        guard = self.guards.get(layout)
        stale = guard is not None and not guard(leaves)
        self.rebuilds += stale
        if (guard is None and len(self.guards) < _MAX_GUARDS) or (stale and self.rebuilds <= _MAX_REBUILDS):
            guard = self.guards[layout] = state_guard(
                given=self.given, modules=self.modules, dicts=self.dicts, optimizers=self.optimizers,
                groups=self.groups, extras=self.extras, tensors=self.tensors, args=leaves)
        elif stale:
            guard = None
        if guard is not None:
            return guard
        return lambda now: self.unchanged() and fits(now)

    def lrs(self) -> list[float]:
        """Each param group's learning rate (valid while ``unchanged()``: the groups are the snapshot's)."""
        return list(map(float, map(_LR, self.groups)))


def args_check(leaves: Sequence) -> Callable[[Sequence], bool] | None:
    """A check that a step's flattened arguments have the types and layouts of ``leaves``, when all of them are
    tensors (what a step's signature compares, ``tracer._arg_meta``); ``None`` otherwise (the signature is then
    computed anew)."""
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return None
    n, check = len(leaves), layout_check(leaves)
    return lambda now: len(now) == n and check(*now)
