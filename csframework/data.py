"""Data loaders owned by the framework: a sampler whose order is a function of (seed, epoch) and which can
start in the middle of an epoch, so resume is exact and distributed sharding is explicit."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .rng import seed_everything


class ResumableSampler(Sampler[int]):
    """Indices of one epoch for one rank: permuted by ``seed + epoch`` when shuffling, sharded by rank,
    starting at ``start`` (samples already consumed in this epoch)."""

    def __init__(self, size: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.size, generator=g)
        else:
            order = torch.arange(self.size)
        per_rank = self.size // self.world_size  # equal shards, so every rank takes the same steps
        order = order[self.rank: per_rank * self.world_size: self.world_size]
        return iter(order[self.start:].tolist())

    def __len__(self) -> int:
        return self.size // self.world_size - self.start


def _seed_worker(worker_id: int) -> None:
    """Start of a loader worker. It ignores SIGINT/SIGTERM (the main process stops the run, then its
    workers), and seeds Python, NumPy and torch before each batch from the epoch's seed and the batch's
    first sample: a batch's random augmentations then depend neither on which worker loads it nor on
    where in the epoch a resumed run started, so resume is exact with workers too."""
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)

    seed_everything(torch.initial_seed() % 2**32)
    info = torch.utils.data.get_worker_info()
    epoch_seed, dataset = info.seed - info.id, info.dataset  # the loader's base seed, drawn per epoch
    getitems = getattr(dataset, "__getitems__", None)

    def seeded_getitems(indices):
        seed_everything((epoch_seed * 1_000_003 + int(indices[0])) % 2**63)
        return getitems(indices) if getitems else [dataset[i] for i in indices]

    try:  # the fetcher calls dataset.__getitems__(batch indices) when the dataset has one
        dataset.__getitems__ = seeded_getitems
    except AttributeError:  # pragma: no cover - a dataset with __slots__: seeded per worker only
        pass


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, num_workers: int,
                drop_last: bool, rank: int = 0, world_size: int = 1, pin_memory: bool = False):
    """A ``DataLoader`` over ``dataset`` with a ``ResumableSampler`` (reachable as ``loader.sampler``)."""
    try:
        size = len(dataset)
    except TypeError as e:
        raise TypeError(f"{type(dataset).__name__} is not a map-style dataset with __len__") from e
    sampler = ResumableSampler(size, shuffle, seed, rank, world_size)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      drop_last=drop_last, pin_memory=pin_memory, worker_init_fn=_seed_worker,
                      generator=torch.Generator().manual_seed(seed))


def epoch_batches(loader: DataLoader, epoch: int, start_batch: int = 0):
    """Iterate the batches of ``epoch`` starting after ``start_batch`` batches."""
    loader.sampler.set_epoch(epoch, start_batch * loader.batch_size)
    loader.generator.manual_seed(loader.sampler.seed * 1_000_003 + epoch)  # worker seeds per epoch
    return iter(loader)


def move_to(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor moved to ``device`` (tuples, lists and dicts are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_to(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to(v, device, non_blocking) for v in batch]
        return type(batch)(moved) if isinstance(batch, list) else tuple(moved)
    return batch
