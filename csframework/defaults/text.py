"""Byte-level text from the Python standard library's own source files: always present, no download."""
from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


@functools.lru_cache(maxsize=4)
def stdlib_bytes(num_chars: int) -> torch.Tensor:
    """The first ``num_chars`` bytes of the stdlib's top-level ``*.py`` files, in sorted order (so the same
    Python version always yields the same text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= num_chars:
            break
    if total < 2:
        raise FileNotFoundError(f"no Python source found under {root}")
    text = b"".join(chunks)[:num_chars]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class StdlibText(Dataset):
    """Non-overlapping windows of ``block_size`` bytes; item ``i`` is ``(inputs, targets)`` with the targets
    shifted by one byte. ``split="train"`` is the first 90% of the text, ``"val"`` the rest."""

    def __init__(self, split: str = "train", block_size: int = 64, num_chars: int = 600_000):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = stdlib_bytes(num_chars)
        cut = int(len(data) * 0.9)
        self.data = data[:cut] if split == "train" else data[cut:]
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int):
        start = i * self.block_size
        chunk = self.data[start: start + self.block_size + 1]
        return chunk[:-1], chunk[1:]

    def __getbatch__(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """The samples ``indices`` as the loader's collate makes them, ``[inputs, targets]``, read in one
        ``index_select`` each (the loader's batched fast path, ``data.batched_fetch``): window ``i`` of
        ``data`` and of ``data`` shifted by one byte are rows ``i`` of these views."""
        size = self.block_size
        return [self.data.unfold(0, size, size).index_select(0, indices),
                self.data[1:].unfold(0, size, size).index_select(0, indices)]
