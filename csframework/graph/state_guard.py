"""The state watch's identity comparisons as one C call: torch's guard manager (the tree of checks Dynamo runs
before a compiled frame) built once per ``watch.StateWatch``.

``StateWatch._take`` gathers some sixty objects a step on a small model in Python and compares them with the
snapshot's; on the blobs MLP that was a third of the emulator's own time a step (issue 52), most of it in
the caches the graph's kernels had just emptied. The guard checks the same things, in C, by identity:

* each list the caller gave (modules, optimizers): its length and items;
* each module's ``training`` flag, and the items of its ``_parameters``, ``_buffers`` and ``_modules``, in
  order (keys and values);
* each optimizer's ``param_groups`` list (the object, its length and items) and ``state`` (the object, its
  length, each parameter key, each entry dict and that dict's keys and values);
* each group's keys and values (in order) but the learning rate (a graph input); its ``params`` list item by
  item;
* each extra state attribute (loss scaling's).

This is a private torch API: it is used only where it builds, passes its own check of a small structure
(``_works``: each kind of change caught) and holds for the snapshot it was built from; anywhere else
(torch 2.4, the Cerebras stage, lacks this signature) the watch compares in Python (``StateWatch._take``).
The objects are compared by ``id``: the watch keeps a reference to each (its snapshot), so no id is reused.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Sequence


def identity_guard(given: Sequence[Sequence], modules: Sequence, dicts: Sequence[dict], optimizers: Sequence,
                   groups: Sequence[dict], extras: tuple[list, list]) -> Callable[[], bool] | None:
    """A check, called without arguments, that the objects the watch compares by identity are all still
    the snapshot's (see the module's docstring); ``None`` where this torch has no usable guard manager."""
    return _build(given, modules, dicts, optimizers, groups, extras) if _works() else None


def _build(given, modules, dicts, optimizers, groups, extras) -> Callable[[], bool] | None:
    try:
        roots = (*given, *modules, *dicts, *optimizers, *groups, *extras[0])
        root = _Builder(roots).build(given, modules, dicts, optimizers, groups, extras)
        if root.check(roots):
            return functools.partial(root.check, roots)
    except Exception:  # noqa: BLE001 - a private API: any change of it leaves the Python comparison
        pass
    return None


class _Builder:
    """Adds the checks to a ``RootGuardManager`` whose value is ``roots`` (one accessor per root object)."""

    def __init__(self, roots: tuple):
        from torch._C._dynamo.guards import RootGuardManager
        from torch._dynamo.guards import GuardManagerType

        self.root, self.roots, self.next = RootGuardManager(), roots, 0
        self.plain, self.mapping = GuardManagerType.GUARD_MANAGER, GuardManagerType.DICT_GUARD_MANAGER

    def build(self, given, modules, dicts, optimizers, groups, extras) -> Any:
        for items in given:
            self.items(self.at(items, self.plain), items)
        for module in modules:
            self.same(self.at(module, self.plain).getattr_manager("training", "training", module.training,
                                                                   self.plain), module.training)
        for d in dicts:
            self.entries(self.at(d, self.mapping), d)
        for opt in optimizers:
            self.optimizer(self.at(opt, self.plain), opt)
        for group in groups:
            self.group(self.at(group, self.mapping), group)
        for obj, attr in zip(*extras):
            value = getattr(obj, attr)
            self.same(self.at(obj, self.plain).getattr_manager(attr, attr, value, self.plain), value)
        return self.root

    def at(self, obj, kind) -> Any:
        """The manager of the next root object (``roots`` holds them in the order ``build`` takes them)."""
        assert self.roots[self.next] is obj
        manager = self.root.tuple_getitem_manager(self.next, f"roots[{self.next}]", obj, kind)
        self.next += 1
        return manager

    @staticmethod
    def same(manager, value) -> None:
        manager.add_id_match_guard(id(value), [f"id {id(value)}"], None)

    def items(self, manager, items: list) -> None:
        manager.add_length_check_guard(len(items), [f"len {len(items)}"], None)
        for i, item in enumerate(items):
            self.same(manager.list_getitem_manager(i, f"[{i}]", item, self.plain), item)

    def entries(self, manager, d: dict, skip: str | None = None) -> list:
        """Each item of ``d`` in order, key and value by identity (the value of key ``skip`` not checked);
        returns ``(key, value, value manager)`` of the others."""
        manager.add_dict_length_check_guard(len(d), [f"len {len(d)}"], None)
        out = []
        for i, (key, value) in enumerate(d.items()):
            self.same(manager.get_key_manager(i, f"key {i}", key, self.plain), key)
            if key != skip:
                kind = self.mapping if type(value) is dict else self.plain
                value_manager = manager.get_value_manager(i, f"value {i}", value, kind)
                self.same(value_manager, value)
                out.append((key, value, value_manager))
        return out

    def optimizer(self, manager, opt) -> None:
        groups = opt.param_groups
        groups_manager = manager.getattr_manager("param_groups", "param_groups", groups, self.plain)
        self.same(groups_manager, groups)
        self.items(groups_manager, groups)
        state = opt.state
        state_manager = manager.getattr_manager("state", "state", state, self.mapping)
        self.same(state_manager, state)
        for _, entry, entry_manager in self.entries(state_manager, state):
            self.entries(entry_manager, entry)

    def group(self, manager, group: dict) -> None:
        for key, value, value_manager in self.entries(manager, group, skip="lr"):
            if key == "params":
                self.items(value_manager, value)


@functools.lru_cache(maxsize=None)
def _works() -> bool:
    """Whether this torch's guard manager builds and catches each kind of change on a small structure (a
    removed private API, or one whose checks mean something else, leaves the Python comparison)."""
    if "torch._dynamo" not in sys.modules:  # importing Dynamo takes a second; a trace imports it anyway
        import torch._dynamo  # noqa: F401
    try:
        flag, items, entry = _Flag(), [object()], {"a": object(), "lr": 1.0, "params": [object()]}
        params = {"weight": object()}
        opt, extra = _Flag(), _Flag()
        opt.param_groups, opt.state = [entry], {object(): {"k": object()}}

        def guard():
            return _build([items], [flag], [params], [opt], [entry], ([extra], ["training"]))

        check = guard()
        entry["lr"] = 2.0  # not compared
        if check is None or not check():
            return False
        changes = [lambda: setattr(flag, "training", False), lambda: items.append(1),
                   lambda: params.__setitem__("weight", object()),
                   lambda: entry.__setitem__("a", object()), lambda: entry.__setitem__("new", 1),
                   lambda: entry["params"].append(2), lambda: next(iter(opt.state.values())).__setitem__("k", 1),
                   lambda: opt.state.__setitem__(object(), {}), lambda: setattr(opt, "param_groups", [entry]), lambda: setattr(extra, "training", 2)]
        for change in changes:
            check = guard()
            change()
            if check is None or check():
                return False
        return True
    except Exception:  # noqa: BLE001 - a private API: any failure means "not usable"
        return False


class _Flag:
    """An object with attributes, as a module or an optimizer."""

    def __init__(self):
        self.training = True
