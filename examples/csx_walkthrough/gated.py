"""A small classifier whose forward pass branches on its data, and the same model with the branch made
traceable. The CSX backend traces the step once into a static graph, so Python cannot branch on a tensor's
value there: ``GatedNet`` fails at its first trace, ``WhereGatedNet`` trains."""
from __future__ import annotations

import torch
from torch import nn


class GatedNet(nn.Module):
    """An MLP that doubles its hidden features when their mean is positive, decided in Python."""

    def __init__(self, dim: int = 4, hidden: int = 32, classes: int = 3):
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh())
        self.classify = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        if h.mean() > 0:  # reads the tensor's value: a Python branch the graph cannot hold
            h = h * 2
        return self.classify(h)


class WhereGatedNet(GatedNet):
    """The same computation with the choice made in the graph (``torch.where``): traceable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        h = torch.where(h.mean() > 0, h * 2, h)
        return self.classify(h)


class CountingNet(WhereGatedNet):
    """``WhereGatedNet`` that prints each time its forward pass runs in Python (a side effect)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingNet.calls += 1
        print(f"forward ran in Python ({CountingNet.calls})", flush=True)
        return super().forward(x)


class DriftingNet(WhereGatedNet):
    """``WhereGatedNet`` whose graph depends on Python state: from its second trace on, it adds a scaling.
    Traced once, the change never shows; ``backend.retrace_every_iteration=true`` catches it."""

    traces = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        DriftingNet.traces += 1
        logits = super().forward(x)
        return logits * 0.5 if DriftingNet.traces > 1 else logits
