"""The batched fast path of map-style datasets: a loader that reads each batch with one indexing operation
instead of ``batch_size`` calls of ``__getitem__`` and a per-sample ``default_collate`` (about 400 us per
batch of 64 on an MLP, more than many steps' own overhead).

A dataset qualifies when ``batch_reader`` finds a way to read a whole batch: its own ``__getbatch__``, or
the tensors of a plain ``TensorDataset``. The loader then has no auto-batching (``batch_size=None``): its
sampler, ``BatchIndices``, yields the batches a ``BatchSampler`` makes of the same ``ResumableSampler``
order (same order, same ``drop_last``, same resume position), and ``BatchReader`` turns each into the batch.
``data.make_loader`` picks this path; ``data.batched_fetch=false`` or a ``data.collate_fn`` turn it off.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.data import Dataset, Sampler, TensorDataset

from .rng import seed_batch


def batch_reader(dataset: Dataset) -> Callable[[torch.Tensor], Any] | None:
    """How to read a whole batch of ``dataset`` at once, or ``None`` (read it sample by sample).

    * A dataset with a ``__getbatch__(indices)`` method (the opt-in for your own datasets): ``indices`` is
      a 1-D int64 tensor of sample indices, and it returns the batch the per-sample path would make,
      ``default_collate([dataset[i] for i in indices])``, in new tensors as a collate makes (not views of
      the dataset's storage), e.g. ``[x[indices], y[indices]]`` for samples that are ``(x[i], y[i])``
      tuples (``default_collate`` makes a list of a tuple's fields).
    * A ``TensorDataset`` whose class overrides neither ``__getitem__`` nor ``__getitems__``: one
      ``index_select`` per tensor, as a list (that same collated batch, bit for bit).
    """
    getbatch = getattr(dataset, "__getbatch__", None)
    if getbatch is not None:
        if not callable(getbatch):
            raise TypeError(f"{type(dataset).__name__}.__getbatch__ is a {type(getbatch).__name__}, not a method; "
                            "define __getbatch__(self, indices) returning the collated batch, or remove it")
        return getbatch
    cls = type(dataset)
    if (isinstance(dataset, TensorDataset) and cls.__getitem__ is TensorDataset.__getitem__
            and getattr(cls, "__getitems__", None) is None):
        return functools.partial(_select, dataset.tensors)
    return None


def _select(tensors: tuple[torch.Tensor, ...], indices: torch.Tensor) -> list[torch.Tensor]:
    # index_select, not tensor[indices]: the same copy, but advanced indexing costs 4x more on CPU
    return [t.index_select(0, indices) for t in tensors]


class BatchIndices(Sampler):
    """The batches ``BatchSampler(sampler, batch_size, drop_last)`` makes of a ``ResumableSampler``, each
    one tensor of indices; a list with ``as_lists`` (for loader workers: a list pickles cheaply, a tensor
    would be moved to shared memory for every batch)."""

    def __init__(self, sampler, batch_size: int, drop_last: bool, as_lists: bool = False):
        self.sampler, self.batch_size, self.drop_last, self.as_lists = sampler, batch_size, drop_last, as_lists

    def __iter__(self):
        order = self.sampler.order()
        if self.drop_last:
            order = order[: len(order) // self.batch_size * self.batch_size]
        batches = order.split(self.batch_size)
        return iter([b.tolist() for b in batches] if self.as_lists else batches)

    def __len__(self) -> int:
        samples = len(self.sampler)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)


class BatchReader(Dataset):
    """``dataset`` as a loader without auto-batching reads it: item ``indices`` (one batch from
    ``BatchIndices``) is the whole batch, read by ``read`` (from ``batch_reader``). With ``tagged`` (loader
    workers) indices come as ``epoch * len + index`` and each batch is read after seeding every generator
    as ``data.WorkerSeeded`` does, so a ``__getbatch__`` with random augmentations resumes exactly."""

    def __init__(self, dataset: Dataset, read: Callable[[torch.Tensor], Any], seed: int, tagged: bool):
        self.dataset, self.read, self.seed, self.tagged = dataset, read, seed, tagged
        self.size = len(dataset)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, indices):
        indices = torch.as_tensor(indices, dtype=torch.int64)
        if self.tagged:
            seed_batch(self.seed, self.size, int(indices[0]))
            indices = indices % self.size
        return self.read(indices)

    def reader(self) -> str:
        """What reads a batch, for error messages."""
        name = type(self.dataset).__name__
        return f"{name}.__getbatch__" if hasattr(self.dataset, "__getbatch__") else f"{name} (index_select)"


#: The most a ``TensorDataset`` pass reads ahead at once (bytes): bounded, so a big dataset is not copied.
READ_AHEAD_BYTES = 2**20


class InProcessPass:
    """One pass of a batched loader without workers or pinned memory, read here: the ``DataLoader``'s own
    single-process iterator would add about 20 us per batch (a profiler record, the fetcher, a conversion
    walk) to a read that takes as long, for nothing this path needs.

    A plain ``TensorDataset`` is read a few batches at a time (up to ``READ_AHEAD_BYTES``; more stops paying
    on wide rows, whose chunks no longer stay in cache): one ``index_select`` per tensor for them all, each
    batch then a contiguous slice of it. The same values in the same order; a per-batch cost that a step on
    a small model would notice is paid once per chunk."""

    def __init__(self, sampler: BatchIndices, reader: BatchReader):
        self._indices, self._read, self._length = iter(sampler), reader.__getitem__, len(sampler)
        self._ahead: list = []
        plain = isinstance(reader.read, functools.partial) and reader.read.func is _select
        tensors = reader.read.args[0] if plain else None
        self._tensors = tensors if tensors is not None and not reader.tagged else None
        if self._tensors is not None:
            row = sum(t[:1].numel() * t.element_size() for t in self._tensors)
            self._chunk = max(1, min(64, READ_AHEAD_BYTES // max(1, row * sampler.batch_size)))

    def __len__(self) -> int:
        return self._length

    def __iter__(self):
        return self

    def __next__(self):
        if self._tensors is None:
            return self._read(next(self._indices))
        if not self._ahead:
            # range first: zip then stops without taking one more batch of indices from the sampler
            indices = [i for _, i in zip(range(self._chunk), self._indices)]
            if not indices:
                raise StopIteration
            sizes = [len(i) for i in indices]
            columns = [t.split(sizes) for t in _select(self._tensors, torch.cat(indices))]
            self._ahead = [list(batch) for batch in zip(*columns)][::-1]
        return self._ahead.pop()


def as_is(batch):
    """The collate of a loader without auto-batching over a ``BatchReader``: its batches are made already."""
    return batch
