"""Data loaders owned by the framework: a sampler whose order is a function of (seed, epoch) and which can
start in the middle of an epoch, so resume is exact and distributed sharding is explicit; iterable datasets
sharded across ranks and workers the same way."""
from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info


class ResumableSampler(Sampler[int]):
    """Indices of one epoch for one rank: permuted by ``seed + epoch`` when shuffling, sharded by rank,
    starting at ``start`` (samples already consumed in this epoch). With ``tag_epoch`` each index is sent as
    ``epoch * size + index`` (for ``WorkerSeeded``, which seeds each batch by its epoch)."""

    def __init__(self, size: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1,
                 tag_epoch: bool = False):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.tag_epoch = rank, world_size, tag_epoch
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
        order = order[self.rank: per_rank * self.world_size: self.world_size][self.start:]
        if self.tag_epoch:
            order = order + self.epoch * self.size
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.size // self.world_size - self.start


def _seed_all(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class WorkerSeeded(Dataset):
    """A map-style dataset as loader workers read it: the sampler sends ``epoch * len + index``, and each
    batch is fetched after seeding Python, NumPy and torch from (seed, epoch, first index). A batch's random
    augmentations then depend neither on which worker loads it, nor on where in the epoch a resumed run
    started, nor on whether the workers persist across epochs (``data.persistent_workers``), so resume is
    exact with workers too."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.size = dataset, seed, len(dataset)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, tagged: int):
        return self.__getitems__([tagged])[0]

    def __getitems__(self, tagged: list):
        epoch, first = divmod(int(tagged[0]), self.size)
        _seed_all(((self.seed * 1_000_003 + epoch) * 1_000_003 + first) % 2**63)
        indices = [int(i) % self.size for i in tagged]
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(indices) if getitems else [self.dataset[i] for i in indices]


class IterableShards(IterableDataset):
    """An ``IterableDataset`` as one rank and one loader worker read it, so each sample is read once per
    epoch across ranks and workers, in the batches a single process would make.

    Of every ``world_size`` consecutive samples, rank r keeps the r-th (an incomplete last group is dropped,
    so every rank takes the same number of steps); of the rank's batches, worker w loads every
    ``num_workers``-th, which the loader's round robin yields in order. ``set_epoch(epoch, start)`` passes
    the epoch on (to the dataset's own ``set_epoch`` if it has one) and skips the first ``start`` samples of
    the rank's share: resume re-reads the epoch up to its position, exact when the dataset yields the same
    samples for the same epoch. A dataset with ``state_dict``/``load_state_dict`` is restored from the
    checkpoint instead (with ``data.num_workers=0``, where its state is this process's)."""

    def __init__(self, dataset: IterableDataset, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0
        self.restored = False  # load_state_dict() ran: the dataset continues by itself, skip nothing

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, 0 if self.restored else start
        self.restored = False
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def stateful(self) -> bool:
        return callable(getattr(self.dataset, "state_dict", None)) and callable(
            getattr(self.dataset, "load_state_dict", None))

    def state_dict(self):
        return self.dataset.state_dict()

    def load_state_dict(self, state) -> None:
        self.dataset.load_state_dict(state)
        self.restored = True

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        group: list = []
        position = 0  # in this rank's share of the epoch
        for sample in self.dataset:
            group.append(sample)
            if len(group) < self.world_size:
                continue
            mine, group = group[self.rank], []
            if position >= self.start and ((position - self.start) // self.batch_size) % workers == worker:
                yield mine
            position += 1


def _worker_start(worker_id: int) -> None:
    """Start of a loader worker: it ignores SIGINT/SIGTERM (the main process stops the run, then its
    workers) and seeds every generator from torch's per-worker seed (``WorkerSeeded`` reseeds per batch)."""
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    _seed_all(torch.initial_seed() % 2**32)


def build_collate(spec: Any, key: str = "data.collate_fn"):
    """The ``collate_fn`` of ``spec`` (``None``: torch's default): a ``_target_`` naming a function (the other
    keys are bound as keyword arguments) or a class (built with them; its instances are called)."""
    if spec is None:
        return None
    from hydra._internal.utils import _locate
    from hydra.utils import instantiate

    from .errors import ConfigError

    from .schedule import plain

    spec = {"_target_": spec} if isinstance(spec, str) else plain(spec)
    target = spec.pop("_target_", None)
    try:
        found = _locate(target)
        made = instantiate({"_target_": target, **spec}) if isinstance(found, type) else (
            functools.partial(found, **spec) if spec else found)
    except Exception as e:
        raise ConfigError(f"{key}: could not build '{target}': " + " ".join(str(e).split())) from e
    if not callable(made):
        raise ConfigError(f"{key}: '{target}' built a {type(made).__name__}, which is not callable")
    return made


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, num_workers: int,
                drop_last: bool, rank: int = 0, world_size: int = 1, pin_memory: bool = False,
                collate_fn=None, persistent_workers: bool = False, prefetch_factor: int | None = None):
    """A ``DataLoader`` over ``dataset``: a map-style one through a ``ResumableSampler`` (``loader.sampler``),
    an ``IterableDataset`` through ``IterableShards`` (``loader.dataset``)."""
    from .errors import ConfigError

    common = dict(batch_size=batch_size, num_workers=num_workers, drop_last=drop_last, pin_memory=pin_memory,
                  collate_fn=collate_fn, worker_init_fn=_worker_start, prefetch_factor=prefetch_factor,
                  persistent_workers=persistent_workers and num_workers > 0,
                  generator=torch.Generator().manual_seed(seed))
    if isinstance(dataset, IterableDataset):
        if persistent_workers:
            raise ConfigError("data.persistent_workers: an IterableDataset's workers learn the epoch and the "
                              "resume position when they start, so they cannot persist; set it to false")
        return DataLoader(IterableShards(dataset, batch_size, seed, rank, world_size), **common)
    try:
        size = len(dataset)
    except TypeError as e:
        raise TypeError(f"{type(dataset).__name__} is not a map-style dataset with __len__") from e
    sampler = ResumableSampler(size, shuffle, seed, rank, world_size, tag_epoch=num_workers > 0)
    if num_workers > 0:
        dataset = WorkerSeeded(dataset, seed)
    return DataLoader(dataset, sampler=sampler, **common)


def is_iterable(loader: DataLoader) -> bool:
    return isinstance(loader.dataset, IterableShards)


def epoch_batches(loader: DataLoader, epoch: int, start_batch: int = 0):
    """Iterate the batches of ``epoch`` starting after ``start_batch`` batches."""
    position = loader.dataset if is_iterable(loader) else loader.sampler
    position.set_epoch(epoch, start_batch * loader.batch_size)
    loader.generator.manual_seed(position.seed * 1_000_003 + epoch)  # worker seeds per epoch
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
