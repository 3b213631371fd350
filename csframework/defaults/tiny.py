"""A tiny classification set for fast runs (``model=tiny_linear data=tiny_clusters``): what
``csframework.testing``'s ``csf_runner`` trains in a fraction of a second per step."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Clusters(Dataset):
    """``n`` points of ``classes`` noisy clusters in ``dim`` dimensions (cluster ``c`` sits at ``2 * e_c``);
    the same points for the same ``seed``. Item ``i`` is ``(point, label)``."""

    def __init__(self, n: int = 128, dim: int = 4, classes: int = 3, seed: int = 0, noise: float = 0.6):
        if not 1 <= classes <= dim:
            raise ValueError(f"classes ({classes}) must be between 1 and dim ({dim})")
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(n) % classes
        self.points = 2 * torch.eye(dim)[self.labels] + noise * torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.points[i], self.labels[i]

    def __getbatch__(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """The samples ``indices`` as the loader's collate makes them, ``[points, labels]``, one
        ``index_select`` each (the loader's batched fast path, ``data.batched_fetch``)."""
        return [self.points.index_select(0, indices), self.labels.index_select(0, indices)]
