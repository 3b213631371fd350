"""The orders a framework loader reads a dataset in: ``ResumableSampler`` (a map-style dataset: a function
of (seed, epoch), sharded by rank, able to start in the middle of an epoch, so resume is exact),
``WorkerSeeded`` (each batch seeded by its position, whichever worker loads it) and ``IterableShards`` (an
``IterableDataset`` sharded across ranks and workers the same way)."""
from __future__ import annotations

import operator
import reprlib
from typing import Any, Iterator, Sized, cast

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from .errors import ConfigError
from .rng import seed_batch


#: The most samples a map-style dataset may have: the sampler holds each epoch's order in memory as int64
#: indices (8 TiB at this bound), and loader workers receive ``epoch * len + index``, an int64 too.
MAX_DATASET_LEN = 2**40


def dataset_size(dataset: Dataset, role: str) -> int:
    """``len(dataset)`` of a map-style dataset; a ``ConfigError`` naming ``role`` (``data.train``) and the
    value unless ``__len__`` gives an int from 0 to ``MAX_DATASET_LEN``."""
    name = type(dataset).__name__
    length = getattr(type(dataset), "__len__", None)
    if length is None:
        raise ConfigError(f"{role}: {name} has no __len__, so it is no map-style dataset, nor is it an "
                          "IterableDataset; give it __len__ and __getitem__, or derive it from IterableDataset")
    value = length(dataset)  # what len() would check, checked here to name the dataset and the value
    try:
        size = operator.index(value)
    except TypeError:
        size = None
    if size is not None and size > MAX_DATASET_LEN:
        raise ConfigError(f"{role}: {name}.__len__ returned {reprlib.repr(value)}, more than the {MAX_DATASET_LEN} "
                          "samples (2**40) a sampler can index (it holds an epoch's order in memory); make a "
                          "dataset that large an IterableDataset")
    if size is None or size < 0:
        raise ConfigError(f"{role}: {name}.__len__ returned {reprlib.repr(value)}, which is no number of samples; "
                          "it must return an int from 0 up")
    return size


def derived_seed(value: int) -> int:
    """A seed derived from the run's ``seed`` (and the epoch or draw) within ``torch.Generator``'s 64 bits:
    ``value`` itself below 2**64 (every seed up to about 1.8e7 at any epoch: the orders of earlier runs), else
    wrapped (a larger seed, whose draws' formula passes 2**64, once overflowed ``manual_seed``)."""
    return value % 2**64


class ResumableSampler(Sampler[int]):
    """Indices of one epoch for one rank: permuted by ``seed + epoch`` when shuffling, sharded by rank,
    starting at ``start`` (samples already consumed in this epoch). With ``tag_epoch`` each index is sent as
    ``epoch * size + index`` (for ``WorkerSeeded``, which seeds each batch by its epoch).

    Every rank gets the same number of samples, so all take the same steps: training drops the remainder
    of ``size / world_size``; with ``pad`` (evaluation) the order wraps around to fill the last round
    instead, so every sample is seen; sample ``i`` of rank ``r`` is position ``i * world_size + r`` of the
    order, and positions from ``size`` on are the padding (the output collector drops them).

    With ``sample`` (``loop.eval_steps``), a pass reads that many indices drawn without replacement from the
    whole set by ``seed + epoch`` (evaluation: ``set_epoch(draw)`` picks the draw), in dataset order; with
    ``first`` too (``data.eval_sample=sequential``), the set's first ``sample`` indices."""

    def __init__(self, size: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1,
                 tag_epoch: bool = False, pad: bool = False, sample: int | None = None, first: bool = False):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.tag_epoch, self.pad = rank, world_size, tag_epoch, pad
        self.sample = sample if sample is not None and sample < size else None  # None: every index
        self.first = first
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def order(self) -> torch.Tensor:
        """The indices this pass yields, as one tensor."""
        if self.sample is not None and self.first:
            order = torch.arange(self.sample)
        elif self.sample is not None:  # a stream of its own: not the training order of the same seed and epoch
            g = torch.Generator().manual_seed(derived_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + 11))
            order = torch.randperm(self.size, generator=g)[:self.sample].sort().values
        elif self.shuffle:
            g = torch.Generator().manual_seed(derived_seed(self.seed * 1_000_003 + self.epoch))
            order = torch.randperm(self.size, generator=g)
        else:
            order = torch.arange(self.size)
        total = self.per_rank * self.world_size
        if total > len(order):
            order = order.repeat(-(-total // len(order)))
        order = order[self.rank: total: self.world_size][self.start:]
        if self.tag_epoch:
            order = order + self.epoch * self.size
        return order

    @property
    def count(self) -> int:
        """The indices of a pass over all ranks (before padding): the sample's, or the set's size."""
        return self.sample if self.sample is not None else self.size

    @property
    def per_rank(self) -> int:
        if self.pad and self.count:
            return -(-self.count // self.world_size)
        return self.count // self.world_size

    def __len__(self) -> int:
        # a pass resumed after an epoch's short last batch starts past the end: no sample left, not fewer
        return max(0, self.per_rank - self.start)


class WorkerSeeded(Dataset):
    """A map-style dataset as loader workers read it: the sampler sends ``epoch * len + index``, and each
    batch is fetched after seeding Python, NumPy and torch from (seed, epoch, first index). A batch's random
    augmentations then depend neither on which worker loads it, nor on where in the epoch a resumed run
    started, nor on whether the workers persist across epochs (``data.persistent_workers``), so resume is
    exact with workers too."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.size = dataset, seed, len(cast(Sized, dataset))  # checked: dataset_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, tagged: int):
        return self.__getitems__([tagged])[0]

    def __getitems__(self, tagged: list):
        seed_batch(self.seed, self.size, int(tagged[0]))
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
        self.dataset: Any = dataset  # the user's: what else it offers (set_epoch, state_dict) is asked
        self.batch_size, self.seed = batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0
        self.restored = False  # load_state_dict() ran: the dataset continues by itself, skip nothing
        self.pass_ended = False  # this process's pass reached the end of the dataset's iterator
        self.skip_pass = False  # restored where the saved pass had ended: the resumed epoch has no batch left

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

    def load_state_dict(self, state, pass_ended: bool = False) -> None:
        """Restore the dataset; ``pass_ended``: the checkpoint was written after its iterator ended (to make
        a short last batch), so the dataset's state is already the next pass's and the resumed epoch ends."""
        self.dataset.load_state_dict(state)
        self.restored, self.skip_pass = True, pass_ended

    def __iter__(self):
        if self.skip_pass:
            self.skip_pass = False
            return
        self.pass_ended = False
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
        self.pass_ended = True
