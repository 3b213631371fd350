"""A step's whole check as one C call: torch's guard manager (the tree of checks Dynamo runs before a
compiled frame) built once per ``watch.StateWatch`` and arguments' layout.

``StateWatch.unchanged`` gathers some sixty objects a step on a small model in Python and compares them with
the snapshot's, then torch's tensor guard compares the state's layouts, then another the arguments': on the
blobs MLP that was a third of the emulator's own time a step (issue 52), most of it in the caches the graph's
kernels had just emptied. The guard checks the same things in one call, by identity:

* each list the caller gave (modules, optimizers): its length and items;
* each module's ``training`` flag, and the items of its ``_parameters``, ``_buffers`` and ``_modules``, in
  order (keys and values);
* each optimizer's ``param_groups`` list (the object, its length and items) and ``state`` (the object, its
  length, each parameter key, each entry dict and that dict's keys and values);
* each group's keys and values (in order) but the learning rate (a graph input); its ``params`` list item by
  item;
* each extra state attribute (loss scaling's);

and by layout (Dynamo's tensor check: type, dispatch keys, dtype, device, ``requires_grad``, shape) each state
tensor and each argument of the step (their number too).

This is a private torch API: it is used only where it builds, passes its own check of a small structure
(``_works``: each kind of change caught) and holds for the snapshot it was built from; anywhere else
(torch 2.4, the Cerebras stage, lacks this signature) the watch compares in Python (``StateWatch.unchanged``,
``watch.args_check``).
The objects are compared by ``id``: the watch keeps a reference to each (its snapshot), so no id is reused.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Sequence

import torch


def state_guard(given: Sequence[Sequence], modules: Sequence, dicts: Sequence[dict], optimizers: Sequence,
                groups: Sequence[dict], extras: tuple[list, list], tensors: Sequence[torch.Tensor],
                args: Sequence[torch.Tensor]) -> Callable[[Sequence], bool] | None:
    """A check, called with a step's flattened arguments, that the objects the watch compares by identity are
    all still the snapshot's, that ``tensors`` keep their layouts and that the arguments have the layouts of
    ``args`` (see the module's docstring); ``None`` where this torch has no usable guard manager."""
    return _build(given, modules, dicts, optimizers, groups, extras, tensors, args) if _works() else None


def _build(given, modules, dicts, optimizers, groups, extras, tensors, args) -> Callable[[Sequence], bool] | None:
    try:
        entries = [entry for opt in optimizers for entry in opt.state.values()]
        roots = (*given, *modules, *dicts, *optimizers, *entries, *groups, *extras[0], *tensors)
        check = _Builder(roots, args).build(given, modules, dicts, optimizers, entries, groups, extras, tensors).check
        if check((roots, list(args))):
            return lambda now: check((roots, now))
    except Exception:  # noqa: BLE001 - a private API: any change of it leaves the Python comparison
        pass
    return None


class _Builder:
    """Adds the checks to a ``RootGuardManager`` whose value is ``(roots, arguments)`` (one accessor per root
    object, one per argument)."""

    def __init__(self, roots: tuple, args: Sequence[torch.Tensor]):
        from torch._C._dynamo.guards import RootGuardManager
        from torch._dynamo.guards import GuardManagerType

        self.plain, self.mapping = GuardManagerType.GUARD_MANAGER, GuardManagerType.DICT_GUARD_MANAGER
        self.root, self.roots, self.next = RootGuardManager(), roots, 0
        self.base = self.root.tuple_getitem_manager(0, "roots", roots, self.plain)
        arguments = self.root.tuple_getitem_manager(1, "arguments", list(args), self.plain)
        arguments.add_length_check_guard(len(args), [f"len {len(args)}"], None)
        for i, arg in enumerate(args):
            self.layout(arguments.list_getitem_manager(i, f"argument {i}", arg, self.plain), arg)

    def build(self, given, modules, dicts, optimizers, entries, groups, extras, tensors) -> Any:
        for items in given:
            self.items(self.at(items, self.plain), items)
        for module in modules:
            self.same(self.at(module, self.plain).getattr_manager("training", "training", module.training,
                                                                   self.plain), module.training)
        for d in dicts:
            self.unwritten(self.at(d, self.plain), d)
        for opt in optimizers:
            self.optimizer(self.at(opt, self.plain), opt)
        for entry in entries:
            self.unwritten(self.at(entry, self.plain), entry)
        for group in groups:
            self.group(self.at(group, self.plain), group)
        for obj, attr in zip(*extras):
            value = getattr(obj, attr)
            self.same(self.at(obj, self.plain).getattr_manager(attr, attr, value, self.plain), value)
        for tensor in tensors:
            self.layout(self.at(tensor, self.plain), tensor)
        return self.root

    def at(self, obj, kind) -> Any:
        """The manager of the next root object (``roots`` holds them in the order ``build`` takes them)."""
        assert self.roots[self.next] is obj
        manager = self.base.tuple_getitem_manager(self.next, f"roots[{self.next}]", obj, kind)
        self.next += 1
        return manager

    @staticmethod
    def same(manager, value) -> None:
        manager.add_id_match_guard(id(value), [f"id {id(value)}"], None)

    @staticmethod
    def layout(manager, tensor: torch.Tensor) -> None:
        """Dynamo's tensor check: type, dispatch keys, dtype, device, ``requires_grad`` and shape (strides not
        compared), what ``watch.layout_check`` compares."""
        manager.add_tensor_match_guard(tensor, list(tensor.shape), [None] * tensor.dim(), "tensor", ["tensor"],
                                       None, type(tensor), torch._C._dispatch_keys(tensor))

    def items(self, manager, items: list) -> None:
        manager.add_length_check_guard(len(items), [f"len {len(items)}"], None)
        for i, item in enumerate(items):
            self.same(manager.list_getitem_manager(i, f"[{i}]", item, self.plain), item)

    @staticmethod
    def unwritten(manager, d: dict) -> None:
        """``d`` not written since (its version: any item set, added or removed changes it)."""
        manager.add_dict_version_guard(d, ["version"], None)

    def optimizer(self, manager, opt) -> None:
        groups = opt.param_groups
        groups_manager = manager.getattr_manager("param_groups", "param_groups", groups, self.plain)
        self.same(groups_manager, groups)
        self.items(groups_manager, groups)
        state = opt.state
        state_manager = manager.getattr_manager("state", "state", state, self.plain)
        self.same(state_manager, state)
        self.unwritten(state_manager, state)

    def group(self, manager, group: dict) -> None:
        """Its keys in order, and the value of each but the learning rate (rewritten by a schedule at every step,
        so the dict's version does not do), ``params`` item by item."""
        manager.add_mapping_keys_guard(group, ["keys"], None)
        for key, value in group.items():
            if key != "lr":
                value_manager = manager.dict_getitem_manager(key, repr(key), value, self.plain)
                self.same(value_manager, value)
                if key == "params":
                    self.items(value_manager, value)


@functools.lru_cache(maxsize=None)
def _works() -> bool:
    """Whether this torch's guard manager builds and catches each kind of change on a small structure (a
    removed private API, or one whose checks mean something else, leaves the Python comparison)."""
    importlib.import_module("torch._dynamo")  # a second, the first time; the step's trace imports it anyway
    with torch.inference_mode(False), torch.enable_grad():  # the first step may be an evaluation's
        return _catches_every_change()


def _catches_every_change() -> bool:
    try:
        entry: dict[str, Any] = {"a": object(), "lr": 1.0, "params": [object()]}
        flag, items = _Flag(), [object()]
        params = {"weight": object()}
        opt: Any = _Flag()
        extra = _Flag()
        opt.param_groups, opt.state = [entry], {object(): {"k": object()}}
        tensor, arg = torch.zeros(2), torch.zeros(3)

        def guard():
            return _build([items], [flag], [params], [opt], [entry], ([extra], ["training"]), [tensor], [arg])

        check = guard()
        entry["lr"] = 2.0  # not compared
        if check is None or not check([torch.ones(3)]):
            return False
        others: tuple[list, ...] = ([], [arg, arg], [3], [torch.zeros(2)], [torch.zeros(3, dtype=torch.int64)],
                  [torch.zeros(3, requires_grad=True)], [torch.nn.Parameter(arg)])
        if any(map(check, others)):
            return False
        changes = [lambda: setattr(flag, "training", False), lambda: items.append(1),
                   lambda: params.__setitem__("weight", object()), lambda: params.pop("weight"),
                   lambda: params.update(bias=None), lambda: params.setdefault("extra"), params.clear,
                   lambda: entry.update(a=entry.pop("a")),  # the keys' order
                   lambda: entry.__setitem__("a", object()), lambda: entry.__setitem__("new", 1),
                   lambda: entry["params"].append(2), lambda: next(iter(opt.state.values())).__setitem__("k", 1),
                   lambda: opt.state.__setitem__(object(), {}), lambda: setattr(opt, "param_groups", [entry]),
                   lambda: setattr(extra, "training", 2), lambda: tensor.requires_grad_(True),
                   lambda: setattr(tensor, "data", torch.zeros(3))]
        for change in changes:
            check = guard()
            change()
            if check is None or check([arg]):
                return False
        return True
    except Exception:  # noqa: BLE001 - a private API: any failure means "not usable"
        return False


class _Flag:
    """An object with attributes, as a module or an optimizer."""

    def __init__(self):
        self.training = True
