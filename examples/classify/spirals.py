"""The example's own data and network: points on interleaved spiral arms, and a small MLP that tells the arms
apart. Nothing here knows about csframework; the config files point at these classes with ``_target_``."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset


class Spirals(Dataset):
    """``n`` points in 2-D on ``arms`` interleaved spiral arms (the label is the arm), with Gaussian noise.

    Deterministic for a given ``seed``; use different seeds for the training and validation sets.
    """

    def __init__(self, n: int = 4096, arms: int = 3, turns: float = 1.5, noise: float = 0.05, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, arms, (n,), generator=g)
        t = 0.15 + 0.85 * torch.rand(n, generator=g)              # position along the arm
        angle = 2 * math.pi * (turns * t + self.y / arms)
        self.x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
        self.x += noise * torch.randn(n, 2, generator=g)
        self.classes = arms

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class SpiralNet(nn.Module):
    """An MLP from 2-D points to ``classes`` logits."""

    def __init__(self, hidden: int = 64, depth: int = 3, classes: int = 3):
        super().__init__()
        layers, width = [], 2
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
