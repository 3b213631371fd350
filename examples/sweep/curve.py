"""A small regression problem where the learning rate and weight decay both matter: 48 noisy samples of a
smooth curve, fitted by an MLP big enough to chase the noise. The validation set is the noise-free curve
on a fine grid, so ``val/loss`` measures how well a fit generalises."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset


def _curve(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(2 * math.pi * x) + 0.5 * x


def curve(split: str = "train", n: int = 48, noise: float = 0.3, seed: int = 0) -> TensorDataset:
    """``train``: ``n`` points drawn in [-1, 1] with Gaussian noise; ``val``: 256 exact points on a grid."""
    if split == "train":
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(n, 1, generator=g) * 2 - 1
        y = _curve(x) + noise * torch.randn(n, 1, generator=g)
    else:
        x = torch.linspace(-1, 1, 256).unsqueeze(1)
        y = _curve(x)
    return TensorDataset(x, y)


def mlp(hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 1))
