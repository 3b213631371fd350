"""A compiled forward that changes a parameter or buffer in place runs eagerly: its gradient stays eager's.

torch.compile's training graph computes a wrong gradient for some forwards that change module state in place:
AOTAutograd functionalises ``self.calls.add_(1); y = x / self.calls`` and its backward may recompute
``calls + 1`` from the buffer, which the forward has changed by then (issue 47: 0.0153 from eager after 6
steps, no error). Which patterns go wrong depends on torch's partitioner, so the rule is plain: every graph
``torch.compile`` captures for training is run once on fake tensors (no real tensor is touched, no random state
drawn) before it is compiled, and a graph that changes a parameter or buffer of the model in place runs eagerly
(Dynamo's captured operations, eager autograd) instead of Inductor's code. The run says so once per change (the
same change in every layer of a block class is one), naming the modules (``StateChange``, ``warn``). Evaluation's
graphs (no gradient) compile as before: their forward is right. The optimizer's update, which changes the
parameters by design, is compiled under ``no_grad``: no training graph, no check.

Exempt: the running statistics of torch's batch norm (``running_mean``, ``running_var``, ``num_batches_tracked``),
which its backward never reads (tests/unit/test_compile_mutation.py compares a compiled model of BatchNorm blocks
with eager). The whole step as one graph (``whole_step``) is traced by csframework's own tracer, whose backward is
eager autograd's on the changed state: it needs no exception.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: Buffers that torch's normalisation layers update in their forward and their backward never reads.
NORM_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class StateChange:
    """A parameter or buffer that a compiled graph changes in place."""
    module: str  # the owning module's qualified name, "" for the model itself
    cls: str  # the owning module's class
    name: str  # the attribute
    kind: str  # "parameter" or "buffer"
    op: str  # the in-place operation (``add_``, ``copy_``)

    def where(self) -> str:
        """``blocks.0 (Block)``: the owning module's qualified name and class."""
        return f"{self.module or 'the model'} ({self.cls})"

    def key(self) -> tuple:
        """The same change in another layer of the same class has the same key (said once)."""
        return self.cls, self.name, self.kind, self.op

    def __str__(self) -> str:
        tensor = f"{self.module}.{self.name}" if self.module else self.name
        return f"{self.kind} {tensor} ({self.cls}) changed in place ({self.op})"


def owners(model: nn.Module) -> dict[int, tuple[str, nn.Module, str, str]]:
    """Each parameter and buffer of ``model`` by ``id``: (the module's qualified name, the module, the attribute,
    ``parameter``/``buffer``); a tensor two modules share is the first's."""
    found: dict[int, tuple[str, nn.Module, str, str]] = {}
    for qualified, module in model.named_modules(remove_duplicate=False):
        for kind, tensors in (("parameter", module.named_parameters(recurse=False)),
                              ("buffer", module.named_buffers(recurse=False))):
            for name, tensor in tensors:
                found.setdefault(id(tensor), (qualified, module, name, kind))
    return found


def _exempt(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.modules.batchnorm._NormBase) and name in NORM_STATS


class _Writes(TorchDispatchMode):
    """The first in-place operation on each of ``tensors`` (by position), from their version counters (which an
    in-place operation, or one on a view of the tensor, moves on: after the operation returns, so each change is
    seen at the next operation or at ``finish``)."""

    def __init__(self, tensors: dict[int, torch.Tensor]):
        super().__init__()
        self.tensors = tensors
        self.versions = {i: t._version for i, t in tensors.items()}
        self.found: dict[int, str] = {}
        self.last = "?"

    def _look(self) -> None:
        for i, tensor in self.tensors.items():
            if i not in self.found and tensor._version != self.versions[i]:
                self.found[i] = self.last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._look()
        self.last = func.overloadpacket.__name__
        return func(*args, **(kwargs or {}))

    def finish(self) -> dict[int, str]:
        self._look()
        return self.found


def _fake(mode: Any, tensor: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``mode`` like ``tensor``; Dynamo's own fakes (DDP's bucket graphs get them) are copied
    by shape, not shared (their version counters are Dynamo's)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(tensor, FakeTensor):
        return mode.from_tensor(tensor, static_shapes=True)
    with mode:
        copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    return copy.requires_grad_(tensor.requires_grad)


def written_inputs(gm: torch.fx.GraphModule, example_inputs: list) -> dict[int, str]:
    """The positions of ``example_inputs`` that ``gm`` changes in place, with the operation, found by running it on
    fake copies of them (shapes and dtypes only: nothing real is read or written)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [_fake(mode, t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    writes = _Writes({i: t for i, t in enumerate(fakes) if isinstance(t, torch.Tensor)})
    with mode, writes:
        gm(*fakes)
    return writes.finish()


def trains(example_inputs: list) -> bool:
    """Whether Dynamo's graph is compiled with a backward (AOTAutograd's training graph)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def state_changes(gm: torch.fx.GraphModule, example_inputs: list, model: nn.Module) -> list[StateChange]:
    """The parameters and buffers of ``model`` that ``gm``, a training graph, changes in place (none for an
    evaluation graph); raises what running it on fake tensors raised."""
    if not trains(example_inputs):
        return []
    written = written_inputs(gm, example_inputs)
    named = owners(model) if written else {}
    for tensor in [example_inputs[i] for i in written]:  # Dynamo's fake of a model tensor: that tensor's owner
        converter = getattr(getattr(tensor, "fake_mode", None), "fake_tensor_converter", None)
        if converter is not None and id(tensor) not in named:
            for real in [*model.parameters(), *model.buffers()]:
                fake = converter._get_memo(real)  # (Dynamo's memo: the fake it made of that real tensor)
                if fake is not None:
                    named.setdefault(id(fake), named[id(real)])
    changes = []
    for position, op in written.items():
        owner = named.get(id(example_inputs[position]))
        if owner is not None and not _exempt(owner[1], owner[2]):
            qualified, module, name, kind = owner
            changes.append(StateChange(qualified, type(module).__qualname__, name, kind, op))
    return changes


def graph_modules(changes: list[StateChange], model: nn.Module, blocks: list[nn.Module]) -> str:
    """The modules whose graph changes state, as the warning names them: the repeated block (a region) holding each
    change, else each changed tensor's own module (``blocks.0 (Block)``)."""
    region = {name: module for name, module in model.named_modules() if any(module is b for b in blocks)}
    found = set()
    for change in changes:
        block = next((name for name in region if change.module == name or change.module.startswith(name + ".")), None)
        found.add(change.where() if block is None else f"{block} ({type(region[block]).__qualname__})")
    return ", ".join(sorted(found))


def warn(log: Any, changes: list[StateChange], function: str, model: nn.Module, blocks: list[nn.Module]) -> str:
    """One ``compiled_eagerly`` warning for a training graph of ``function`` that changes model state: the modules
    (``graph_modules``), why, what runs eagerly (every layer of a region's class, of ``blocks``) and how to have it
    compiled; returns the modules."""
    where = graph_modules(changes, model, blocks)
    classes = sorted({type(b).__qualname__ for b in blocks if f"({type(b).__qualname__})" in where})
    layers = [b for b in blocks if type(b).__qualname__ in classes]
    what = (f"the {len(layers)} x {'/'.join(classes)} blocks run eagerly in training, the rest compiled" if layers
            else f"that part of the model's {function} runs eagerly in training")
    log.warning("compiled_eagerly", module=where,
                problem=f"the forward changes model state in place: {'; '.join(sorted({str(c) for c in changes}))}; "
                        "torch.compile's gradient of such a forward can differ from eager's",
                result=f"{what}, with eager's numbers; to compile it, move the update out of the forward (into a "
                       "hook after the step), or, in one CPU process, set backend.compile_whole_step=true (the whole "
                       "step as one graph computes eager's gradient)")
    return where
