"""The operation stream of a step: what ``retrace_every_iteration`` compares instead of a whole new graph.

``make_fx`` builds the graph from the ATen operations that reach the dispatcher while the step's Python runs
on fake tensors. ``OpRecorder`` is a dispatch mode that sits above it and writes down that same stream, each
operation with its arguments (a tensor as the operation or graph input that produced it, a Python value as
itself, a real tensor constant by its contents), without building anything. The first trace records the
stream above ``make_fx``; a retrace runs the step's Python again on fake tensors under the recorder alone
(``StepTracer.replay``), which skips the proxy tensors and graph nodes that make most of a trace's cost. Equal
streams over inputs of equal shapes give the same graph, since the graph is built from nothing else; a
different stream is a ``CompileError`` naming the first differing operation and its line.

An interpreted graph needs no fake replay: ``CheckingRecorder`` runs the step on the live tensors and checks each
operation against the first stream before it runs (``StepTracer.run_checked``), so the step executes the
graph's operations in the graph's order, and one that differs is refused before it runs, the state written
until then put back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .errors import user_location
from .passes import _const_desc, op_name


#: What an operation returns that a later one may take: tensors, and opaque handles (the profiler's ranges).
_PRODUCED = (torch.Tensor, torch.ScriptObject)


class OpRecorder(TorchDispatchMode):
    """Records every ATen operation dispatched under it as a comparable tuple (``ops``), with the user's line
    of the torch call that issued it (``wheres``, set by the tracer's ``GuardMode`` through ``where``)."""

    supports_higher_order_operators = True  # passed on untouched; they make the stream opaque (below)
    #: Whether the user's line of an operation is looked up only for a differing one (``CheckingRecorder``,
    #: which stops at it, with the user's code on the stack), not for each (``where``, set by ``GuardMode``).
    where_on_difference = False

    def __init__(self, inputs: Sequence[torch.Tensor]):
        super().__init__()
        self.opaque = False  # a higher-order operator (torch.cond, flex_attention...) ran: its body is not seen
        self.labels: dict[int, Any] = {id(t): ("input", i) for i, t in enumerate(inputs)}
        self.keep: list = list(inputs)  # every labelled tensor stays alive, so no id is reused meanwhile
        self.ops: list[tuple] = []
        self.wheres: list = []
        self.where: tuple | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):  # in the stream by name only: its body is not seen
            self.opaque = True
            entry: tuple = (func, ("higher-order operator",), None)
        elif func.namespace == "prim":  # metadata queries (prim.device): no graph node; what they decide shows
            return func(*args, **kwargs)
        else:
            entry = (func, self.describe(args), self.describe(kwargs) if kwargs else None)
        return self._recorded(entry, func(*args, **kwargs))

    def _recorded(self, entry: tuple, out):
        """Append the operation ``entry`` (at the user's line ``where``) and label what it returned ``out``."""
        index = len(self.ops)
        self.ops.append(entry)
        self.wheres.append(self.where)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for j, t in enumerate(outputs):
            if isinstance(t, _PRODUCED):
                self.labels[id(t)] = (index, j)
                self.keep.append(t)
        return out

    def label(self, t: torch.Tensor):
        """What produced ``t``: a graph input, an operation's output, or (a real tensor) its contents."""
        known = self.labels.get(id(t))
        if known is not None:
            return known
        if isinstance(t, FakeTensor):  # made without an operation seen here (e.g. by autograd): by its metadata
            known = ("tensor", len(self.keep), tuple(t.shape), t.dtype)
        else:  # read its bytes with no mode of the trace in the way (they would make the copy fake)
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                known = ("constant", _const_desc(t))
        self.labels[id(t)] = known
        self.keep.append(t)
        return known

    def describe(self, value):
        if isinstance(value, torch.Tensor):
            return self.label(value)
        if isinstance(value, torch.ScriptObject):  # e.g. the profiler's record_function handle
            return self.labels.get(id(value)) or ("object", type(value).__name__)
        if isinstance(value, (list, tuple)):
            return tuple(self.describe(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, self.describe(v)) for k, v in value.items())
        if isinstance(value, float):  # repr: 1 and 1.0 promote differently, and nan equals itself
            return ("float", repr(value))
        if isinstance(value, bool):
            return ("bool", value)
        if value is None or isinstance(value, (int, str, torch.dtype, torch.device, torch.layout,
                                               torch.memory_format)):
            return value
        return ("object", repr(value))


@dataclass
class Recording:
    """A step's operation stream and where its results went (outputs, closure values, written-back state)."""
    ops: list[tuple]
    wheres: list
    results: tuple = ()
    opaque: bool = False  # a higher-order operator ran: equal streams do not prove equal graphs
    closures: list = field(default_factory=list)
    out_spec: Any = None
    out_leaves: list = field(default_factory=list)
    out_tensor_positions: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """The stream as text, one line per operation (what a difference is reported in)."""
        return [f"{op_name(func)}{args}" + (f" {kwargs}" if kwargs else "") for func, args, kwargs in self.ops] + \
               [f"results {self.results}"]

    def first_difference(self, first: "Recording") -> str | None:
        """``None`` when this stream equals ``first``'s, else a sentence naming the first differing operation
        (and the user's line of it in both streams)."""
        if self.ops == first.ops and self.results == first.results:
            return None
        from .passes import first_difference

        return first_difference(first.lines(), first.wheres + [None], self.lines(), self.wheres + [None])


def finish(recorder: OpRecorder, outputs: Sequence[torch.Tensor], closure_tensors: Sequence[torch.Tensor],
           writebacks: Sequence[tuple[int, torch.Tensor]]) -> Recording:
    """The recording of a step whose Python has run: its operations, and which tensors it returns, hands to
    step closures and writes back into the state (by position)."""
    results = (tuple(recorder.label(t) for t in outputs), tuple(recorder.label(t) for t in closure_tensors),
               tuple((pos, recorder.label(t)) for pos, t in writebacks))
    return Recording(recorder.ops, recorder.wheres, results, opaque=recorder.opaque)


class Diverged(Exception):
    """The live step left the first trace's stream (``CheckingRecorder``); ``difference`` says where."""

    def __init__(self, difference: str):
        super().__init__(difference)
        self.difference = difference


class CheckingRecorder(OpRecorder):
    """Records a step that runs on the live tensors, checking each operation against the first trace's stream
    *before* it runs: an equal operation is the graph's operation (same kernel, same inputs, same order), so
    running the step this way executes the graph; the first differing one stops the step (``diverged``).
    Before an operation writes into a state tensor, that tensor is saved once (``restore`` puts it back)."""

    where_on_difference = True  # the user's line of each operation costs a walk up the stack: only the differing one

    def __init__(self, inputs: Sequence[torch.Tensor], n_state: int, expected: Recording):
        super().__init__(inputs)
        self.expected = expected
        self.diverged: str | None = None
        self.state_of_storage = {t.untyped_storage()._cdata: t for t in inputs[:n_state]}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator) or func.namespace == "prim":
            return super().__torch_dispatch__(func, types, args, kwargs)
        entry = (func, self.describe(args), self.describe(kwargs) if kwargs else None)
        index = len(self.ops)
        expected = self.expected.ops
        if index >= len(expected) or expected[index] != entry:
            self.ops.append(entry)
            self.wheres.append(user_location())
            self.diverged = Recording(self.ops, self.wheres).first_difference(self.expected) or "the traces differ"
            raise Diverged(self.diverged)
        if func._schema.is_mutable:
            with torch._C.DisableTorchFunction():  # the tracer's guard sees none of this
                self._save_written(func, args, kwargs)
        return self._recorded(entry, func(*args, **kwargs))

    def _save_written(self, func, args, kwargs) -> None:
        """Save (once) every state tensor whose storage this operation writes into."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    state = self.state_of_storage.get(t.untyped_storage()._cdata)
                    if state is not None and id(state) not in self.saved:
                        self.saved[id(state)] = (state, state.detach().clone())

    def restore(self) -> None:
        """Put back the state tensors the stopped step wrote into."""
        with torch.no_grad():
            for state, copy in self.saved.values():
                state.copy_(copy)
        self.saved.clear()
