"""A traced graph run at every step on the live state: what ``StaticStep.execute`` does between the state check
and the caller (issue 52: the emulator's own work a step).

``Execution`` is made once per graph and collected state (``tracer.State``, the same while ``watch.StateWatch``
holds) and keeps what a step would otherwise rebuild: the graph's input list (state tensors, learning-rate and
global-step tensors, the slots of the step's tensor arguments), the outputs that must be copied, the state
tensors written back. A step then puts in the arguments, writes the learning rates and the global step where
they changed, runs the graph with autograd off, copies what shares memory with the state, and hands the
values to the step closures (``Delivery``).
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from . import flat
from .passes import fresh_outputs

if TYPE_CHECKING:
    from .replay import Recording
    from .tracer import State, Traced

_VERSION = operator.attrgetter("_version")


class Execution:
    """Runs ``run_graph`` (the GraphModule's ``forward``, or its compiled code) for ``traced`` on ``state``.

    The outputs handed out are copies, but for those of the interpreted graph that are memory of their own
    (``passes.fresh_outputs``). The rate and step tensors are this object's own, written only when their
    value changed or something wrote into them (their version counter moved), so a graph that updates one in
    place changes nothing."""

    def __init__(self, traced: Traced, state: State, run_graph: Callable):
        self.traced, self.state, self.run_graph = traced, state, run_graph
        n_state, n_lrs = len(state.tensors), len(state.lrs)
        with torch.inference_mode(False):  # normal tensors, which either mode may fill
            self.lr_feeds = [torch.zeros((), dtype=torch.float64) for _ in range(n_lrs)]
            self.step_feed = torch.zeros((), dtype=torch.int64)
        self.arg_positions = traced.arg_positions
        self.first_arg = n_state + n_lrs + 1
        self.no_args = [None] * len(traced.arg_positions)
        self.inputs = [*state.tensors, *self.lr_feeds, self.step_feed, *self.no_args]
        # a rate or step the graph does not read (a step that never asks for the global step) is not written
        feeds = [node for node in traced.gm.graph.nodes if node.op == "placeholder"][n_state:self.first_arg]
        self.lrs_read = any(node.users for node in feeds[:n_lrs])
        self.step_read = bool(feeds[n_lrs].users)
        # the values last written into them, and their version counters then
        self.lrs: list[float] | None = None
        self.versions: list[int] = []
        self.step: int | None = None
        self.step_version = -1
        self.n_results = len(traced.out_tensor_positions) + traced.n_closure_tensors
        fresh = None
        if run_graph == traced.gm.forward:  # the interpreted graph: its own results need no copy
            if traced.fresh is None:
                traced.fresh = fresh_outputs(traced.gm)
            fresh = traced.fresh
        self.copied = [i for i in range(self.n_results) if fresh is None or not fresh[i]]
        self.written = [state.tensors[pos] for pos in traced.writebacks]
        self.delivery = Delivery(traced)

    def _feed(self, lrs: list[float], global_step: int) -> None:
        """Write the rates and the step into their tensors, where the graph reads them and they changed."""
        feeds = self.lr_feeds
        if self.lrs_read and (lrs != self.lrs or list(map(_VERSION, feeds)) != self.versions):
            for feed, lr in zip(feeds, lrs):
                feed.fill_(lr)
            self.lrs, self.versions = lrs, list(map(_VERSION, feeds))
        step = self.step_feed
        if self.step_read and (global_step != self.step or step._version != self.step_version):
            step.fill_(global_step)
            self.step, self.step_version = global_step, step._version

    def __call__(self, leaves: list, global_step: int) -> Any:
        """One step: the graph on the live state with ``leaves`` (the step's flattened arguments); returns the
        step's outputs, after the step closures."""
        inputs = self.inputs
        inputs[self.first_arg:] = map(leaves.__getitem__, self.arg_positions)
        self._feed(self.state.lrs, global_step)
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # (as a function: sets the mode) the graph holds the backward pass
        try:
            outs = self.run_graph(*inputs)
            n = self.n_results
            if self.written:
                for target, value in zip(self.written, outs[n:]):
                    target.copy_(value)
            results = list(outs[:n])
            for i in self.copied:
                results[i] = results[i].clone()
        finally:
            torch.set_grad_enabled(grad)
            inputs[self.first_arg:] = self.no_args  # the batch is not kept past its step
        delivery = self.delivery
        if delivery.closures is not self.traced.closures:  # a retrace handed this graph its own (``_same_graph``)
            delivery = self.delivery = Delivery(self.traced)
        return delivery(self.state.optimizers, results)


class Delivery:
    """``deliver`` for one trace's step closures and outputs, with their rebuilders looked up once."""

    def __init__(self, traced: Traced | Recording):
        self.closures = traced.closures
        start, self.calls = len(traced.out_tensor_positions), []
        for closure in traced.closures:
            end = start + len(closure.positions)
            every = end - start == len(closure.leaves)  # every value a tensor: they are the leaves
            self.calls.append((closure.fn, flat.builder(closure.spec), start, end,
                               None if every else (closure.leaves, closure.positions)))
            start = end
        self.out = (flat.builder(traced.out_spec), traced.out_leaves, traced.out_tensor_positions)

    def __call__(self, optimizers: Sequence, results: list) -> Any:
        for opt in optimizers:
            opt._opt_called = True  # the scheduler checks that the optimizer stepped before it
        for fn, build, start, end, placed in self.calls:
            c_args, c_kwargs = build(results[start:end] if placed is None else _placed(*placed, results[start:end]))
            fn(*c_args, **c_kwargs)
        build, leaves, positions = self.out
        return build(_placed(leaves, positions, results) if positions else leaves)


def _placed(leaves: list, positions: list[int], values: list) -> list:
    """``leaves`` with ``values`` at ``positions``."""
    leaves = list(leaves)
    for pos, value in zip(positions, values):
        leaves[pos] = value
    return leaves


def deliver(traced: Traced | Recording, optimizers: Sequence, results: list) -> Any:
    """Run the step closures with their values and return the step's outputs in its structure; ``results``:
    the step's tensor outputs, then the closures' tensor values, in the order the trace recorded them."""
    return Delivery(traced)(optimizers, results)
