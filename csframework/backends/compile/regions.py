"""Regional compilation: a model's repeated blocks compiled once, not once per layer.

Every layer of a transformer is the same code on other parameters. Compiling the whole forward (or the whole
step) inlines each layer, so the graph, and the time to compile it, grows with depth. Here each repeated
block's ``forward`` is compiled once, with its parameters as the graph's inputs (Dynamo's
``inline_inbuilt_nn_modules``), and that one compiled code runs every layer: PyTorch's "regional compilation"
recipe. The model's other code (embeddings, the last norm and head, the loss) runs eagerly around the blocks.

A block is a child of an ``nn.ModuleList`` or ``nn.Sequential`` holding at least ``MIN_REPEATS`` modules of
one class, with submodules of their own and parameters of equal shapes (the layers of every transformer; not
the ``Linear`` layers of an MLP, which are one operation each). The compiled ``forward`` is set on the blocks
only while the compiled step runs them (``installed``): the user's model is never left changed.
"""
from __future__ import annotations

import contextlib
import types
from collections import defaultdict
from typing import Callable, Iterator

from torch import nn

from ...compat import needs_torch
from .scope import fresh_function

#: Modules of one class in one container that make them repeated blocks.
MIN_REPEATS = 2
#: The first torch whose Dynamo lifts a module's parameters into the graph's inputs by default
#: (``inline_inbuilt_nn_modules``): one compiled block then serves every layer. Before it, each layer's
#: parameters are the graph's constants, and each layer would compile again.
REGIONS_TORCH = (2, 5)


def _shapes(module: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())


def _block_like(module: nn.Module) -> bool:
    """A composite module with parameters (a layer of several operations), not one operation."""
    return next(module.children(), None) is not None and next(module.parameters(), None) is not None


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (outermost: a block's own insides are not searched), in model order."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        blocks: list[nn.Module] = []
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            groups: dict[tuple, list[nn.Module]] = defaultdict(list)
            for child in module.children():
                if _block_like(child):
                    groups[(type(child), _shapes(child))].append(child)
            blocks = [b for group in groups.values() if len(group) >= MIN_REPEATS for b in group]
        found.extend(blocks)
        for child in module.children():
            if not any(child is b for b in blocks):
                visit(child)

    visit(model)
    return found


def describe(blocks: list[nn.Module]) -> str:
    """``4 x Block`` (each class's count), what a report names."""
    counts: dict[str, int] = defaultdict(int)
    for block in blocks:
        counts[type(block).__qualname__] += 1
    return ", ".join(f"{n} x {name}" for name, n in counts.items())


def unavailable() -> str | None:
    """Why this torch cannot compile a block once for every layer, or ``None``."""
    return needs_torch("regional compilation (one compiled block for every layer)", REGIONS_TORCH)


class Regions:
    """The repeated blocks of a model and one compiled ``forward`` per block class, made by ``compile``
    (``torch.compile`` with the step's backend) from a code object of this ``Regions``' own, so that Dynamo's
    cache and recompile count of it are this run's alone."""

    def __init__(self, blocks: list[nn.Module], compile: Callable[[Callable], Callable]):
        self.blocks = blocks
        compiled: dict[type, Callable] = {}
        for block in blocks:
            cls = type(block)
            if cls not in compiled:
                compiled[cls] = compile(fresh_function(cls.forward))
        self._forwards = [types.MethodType(compiled[type(block)], block) for block in blocks]

    def __len__(self) -> int:
        return len(self.blocks)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The blocks run the compiled ``forward`` for the duration (an instance attribute, removed after; a block
        with an instance ``forward`` of its own keeps it)."""
        pairs = [(block, forward) for block, forward in zip(self.blocks, self._forwards) if "forward" not in vars(block)]
        for block, forward in pairs:
            block.forward = forward
        try:
            yield
        finally:
            for block, _ in pairs:
                vars(block).pop("forward", None)


def find(model: nn.Module, compile: Callable[[Callable], Callable]) -> Regions | None:
    """``Regions`` of ``model``'s repeated blocks, or ``None`` when it has none or this torch cannot reuse one
    compiled block for every layer."""
    blocks = repeated_blocks(model)
    if not blocks or unavailable() is not None:
        return None
    return Regions(blocks, compile)

