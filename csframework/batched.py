"""The batched fast path of map-style datasets: a loader that reads each batch with one indexing operation
instead of ``batch_size`` calls of ``__getitem__`` and a per-sample ``default_collate`` (about 400 us per
batch of 64 on an MLP, more than many steps' own overhead).

A dataset qualifies when ``batch_reader`` finds a way to read a whole batch: its own ``__getbatch__``, the
tensors of a plain ``TensorDataset``, or a plain ``Subset`` (what ``random_split`` makes) of either. The
loader then has no auto-batching (``batch_size=None``): its sampler, ``BatchIndices``, yields the batches a
``BatchSampler`` makes of the same ``ResumableSampler`` order (same order, same ``drop_last``, same resume
position), and ``BatchReader`` turns each into the batch.
``data.make_loader`` picks this path; ``data.batched_fetch=false`` or a ``data.collate_fn`` turn it off.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sized, TypeGuard, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, Subset, TensorDataset
from torch.utils.data._utils.pin_memory import pin_memory  # the DataLoader's own walk of a batch

from .errors import DataError
from .rng import seed_batch

_D = TypeVar("_D", bound=Dataset)


def batch_reader(dataset: Dataset) -> Callable[[torch.Tensor], Any] | None:
    """How to read a whole batch of ``dataset`` at once, or ``None`` (read it sample by sample).

    * A dataset with a ``__getbatch__(indices)`` method (the opt-in for your own datasets): ``indices`` is
      a 1-D int64 tensor of sample indices, and it returns the batch the per-sample path would make,
      ``default_collate([dataset[i] for i in indices])``, in new tensors as a collate makes (not views of
      the dataset's storage), e.g. ``[x[indices], y[indices]]`` for samples that are ``(x[i], y[i])``
      tuples (``default_collate`` makes a list of a tuple's fields).
    * A ``TensorDataset`` whose class overrides neither ``__getitem__`` nor ``__getitems__``: one
      ``index_select`` per tensor, as a list (that same collated batch, bit for bit).
    * A ``Subset`` whose class overrides neither, of a dataset read in one of these ways, with integer
      indices within its dataset: the batch's indices mapped through ``Subset.indices`` (a negative one
      counted from the end, as ``dataset[i]`` does), then read as a batch.
    """
    getbatch = getattr(dataset, "__getbatch__", None)
    if getbatch is not None:
        if not callable(getbatch):
            raise TypeError(f"{type(dataset).__name__}.__getbatch__ is a {type(getbatch).__name__}, not a method; "
                            "define __getbatch__(self, indices) returning the collated batch, or remove it")
        return getbatch
    if _reads_as(dataset, TensorDataset):
        return functools.partial(_select, dataset.tensors)
    if _reads_as(dataset, Subset):
        inner = batch_reader(dataset.dataset)
        through = _subset_rows(dataset) if inner is not None else None
        if inner is None or through is None:  # sample by sample, where a bad index fails as without this path
            return None
        if isinstance(inner, functools.partial) and inner.func is _select:  # of a (Subset of a) TensorDataset
            before = inner.keywords.get("through")
            return functools.partial(_select, inner.args[0],
                                     through=before.index_select(0, through) if before is not None else through)
        return functools.partial(_read_through, inner, through)
    return None


def _reads_as(dataset: Dataset, base: type[_D]) -> TypeGuard[_D]:
    """``dataset`` is a ``base`` whose class reads samples as ``base`` does (overrides neither reader)."""
    cls = type(dataset)
    return (isinstance(dataset, base) and cls.__getitem__ is base.__getitem__
            and getattr(cls, "__getitems__", None) is getattr(base, "__getitems__", None))


def _subset_rows(subset: Subset) -> torch.Tensor | None:
    """``subset.indices`` as an int64 tensor of rows of its dataset, or ``None`` when they are not 1-D
    integers within it."""
    indices = subset.indices
    if len(indices) == 0:
        return torch.zeros(0, dtype=torch.int64)
    try:
        rows = torch.as_tensor(indices)
    except (TypeError, ValueError, RuntimeError):
        return None
    try:
        size = len(cast(Sized, subset.dataset))  # no __len__: the TypeError below
    except (TypeError, ValueError, OverflowError):  # no usable length: sample by sample, where it fails as usual
        return None
    # uint8 and bool index tensors are masks to torch's indexing, not indices: the per-sample path's way
    if rows.ndim != 1 or rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype in (torch.bool,
                                                                                                  torch.uint8):
        return None
    rows = rows.to(torch.int64)
    if int(rows.min()) < -size or int(rows.max()) >= size:
        return None
    return torch.where(rows < 0, rows + size, rows)


def _select(tensors: tuple[torch.Tensor, ...], indices: torch.Tensor, through: torch.Tensor | None = None
            ) -> list[torch.Tensor]:
    """Rows ``indices`` of each tensor (rows ``through[indices]`` for a ``Subset``)."""
    if through is not None:
        indices = through.index_select(0, indices)
    # index_select, not tensor[indices]: the same copy, and cheaper on CPU (docs/performance.md)
    return [t.index_select(0, indices) for t in tensors]


def _read_through(read: Callable[[torch.Tensor], Any], through: torch.Tensor, indices: torch.Tensor) -> Any:
    """A ``Subset``'s batch: ``read`` (its dataset's batch reader) of ``through[indices]``."""
    return read(through.index_select(0, indices))


def describe(dataset: Dataset) -> str:
    """What reads a batch of ``dataset``, for error messages: ``Name.__getbatch__``, ``Name (index_select)``,
    ``Subset of ...``."""
    if _reads_as(dataset, Subset) and not hasattr(dataset, "__getbatch__"):
        return f"Subset of {describe(dataset.dataset)}"
    name = type(dataset).__name__
    return f"{name}.__getbatch__" if hasattr(dataset, "__getbatch__") else f"{name} (index_select)"


class BatchIndices(Sampler):
    """The batches ``BatchSampler(sampler, batch_size, drop_last)`` makes of a ``ResumableSampler``, each
    one tensor of indices; a list with ``as_lists`` (for loader workers: a list pickles cheaply, a tensor
    would be moved to shared memory for every batch)."""

    def __init__(self, sampler, batch_size: int, drop_last: bool, as_lists: bool = False):
        self.sampler, self.batch_size, self.drop_last, self.as_lists = sampler, batch_size, drop_last, as_lists

    def __iter__(self):
        order = self.order()
        # split() makes one empty batch of no indices; a pass resumed at the end of its epoch has no batch
        batches = order.split(self.batch_size) if len(order) else ()
        return iter([b.tolist() for b in batches] if self.as_lists else batches)

    def order(self) -> torch.Tensor:
        """The pass's indices in order, one tensor, cut where its batches end (``drop_last``): batch ``i`` is
        ``order[i * batch_size: (i + 1) * batch_size]``."""
        order = self.sampler.order()
        if self.drop_last:
            order = order[: len(order) // self.batch_size * self.batch_size]
        return order

    def __len__(self) -> int:
        samples = len(self.sampler)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)


class BatchReader(Dataset):
    """``dataset`` as a loader without auto-batching reads it: item ``indices`` (one batch from
    ``BatchIndices``) is the whole batch, read by ``read`` (from ``batch_reader``). With ``tagged`` (loader
    workers) indices come as ``epoch * len + index`` and each batch is read after seeding every generator
    as ``data.WorkerSeeded`` does, so a ``__getbatch__`` with random augmentations resumes exactly.
    ``role`` names the dataset's key in errors (``data.train``)."""

    def __init__(self, dataset: Dataset, read: Callable[[torch.Tensor], Any], seed: int, tagged: bool,
                 role: str = "data"):
        self.dataset, self.read, self.seed, self.tagged, self.role = dataset, read, seed, tagged, role
        self.size = len(cast(Sized, dataset))  # map-style: data.dataset_size checked its __len__
        # a user's __getbatch__ is checked batch by batch: the length of each tensor, cheap beside a read
        self.user_code = not (isinstance(read, functools.partial) and read.func is _select)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, indices):
        indices = torch.as_tensor(indices, dtype=torch.int64)
        if self.tagged:
            seed_batch(self.seed, self.size, int(indices[0]))
            indices = indices % self.size
        batch = self.read(indices)
        if self.user_code:
            self._check(batch, len(indices))
        return batch

    def _check(self, batch: Any, count: int) -> None:
        """Refuse (``DataError``, naming the key and the method) what is no batch of ``count`` samples:
        ``None``, NumPy arrays, a tensor without ``count`` rows. A model would report these far from their
        cause, or (rows of one tensor missing, another's complete) train on misaligned rows. A batch without
        tensors (strings only, say) is the model's business."""
        if batch is None:
            raise DataError(f"{self.role}: {self.reader()} returned None; it must return the collated batch, as "
                            "tensors, or a list, tuple or dict of them")
        for path, array in arrays(batch):
            if isinstance(array, np.ndarray):
                raise DataError(f"{self.role}: {self.reader()} returned NumPy arrays ({path}); it must return the "
                                "collated batch, as tensors (torch.from_numpy for arrays), or a list, tuple or "
                                "dict of them")
            if array.ndim == 0 or len(array) != count:
                rows = "a 0-d tensor" if array.ndim == 0 else f"{len(array)} rows"
                raise DataError(f"{self.role}: {self.reader()} returned {rows} for {count} indices; it must "
                                f"return one row per index, in their order ({path})")

    def reader(self) -> str:
        """What reads a batch, for error messages."""
        return describe(self.dataset)


def samples_in(batch) -> int | None:
    """The samples in a batch: the length of its first tensor (fields of lists, tuples and dicts walked in
    order, strings skipped); ``None`` when it has no tensor with a batch dimension."""
    if type(batch) in (list, tuple) and batch and isinstance(batch[0], torch.Tensor):  # (x, y, ...): no walk
        first = batch[0]
    else:
        first = first_array(batch)
    return len(first) if isinstance(first, torch.Tensor) and first.ndim else None


def first_array(batch: Any, depth: int = 0):
    """The first tensor or NumPy array in ``batch`` (lists, tuples and dicts walked in order), or ``None``."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch
    if isinstance(batch, (list, tuple, dict)) and depth < 8:
        for item in batch.values() if isinstance(batch, dict) else batch:
            found = first_array(item, depth + 1)
            if found is not None:
                return found
    return None


def arrays(batch: Any, path: str = "batch", depth: int = 0):
    """Every tensor or NumPy array in ``batch`` (lists, tuples and dicts walked in order, 8 levels deep),
    with where it is (``batch[1]``, ``batch['x']``)."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        yield path, batch
    elif isinstance(batch, (list, tuple, dict)) and depth < 8:
        for key, item in batch.items() if isinstance(batch, dict) else enumerate(batch):
            yield from arrays(item, f"{path}[{key!r}]", depth + 1)


#: The most a ``TensorDataset`` pass reads ahead at once (bytes): bounded, so a big dataset is not copied.
READ_AHEAD_BYTES = 2**20


class InProcessPass:
    """One pass of a batched loader without workers, read here: the ``DataLoader``'s own single-process
    iterator would add about 20 us per batch (a profiler record, the fetcher, a conversion walk) to a read
    that takes as long, for nothing this path needs.

    A plain ``TensorDataset`` (or a ``Subset`` of one) is read a few batches at a time (up to
    ``READ_AHEAD_BYTES``; more stops paying on wide rows, whose chunks no longer stay in cache): one
    ``index_select`` per tensor for them all, each batch then a contiguous slice of it. The same values in
    the same order; a per-batch cost that a step on a small model would notice is paid once per chunk.
    ``pin``: batches come in pinned memory, as the ``DataLoader``'s ``pin_memory`` makes them (a chunk is
    pinned once, its batches are slices of it), so that the copy to the GPU overlaps the GPU's work."""

    def __init__(self, sampler: BatchIndices, reader: BatchReader, pin: bool = False):
        self._read, self._length, self._batch = reader.__getitem__, len(sampler), sampler.batch_size
        self._pin = pin
        self._ahead: list = []
        read = reader.read
        select = read if isinstance(read, functools.partial) and read.func is _select else None
        tensors = select.args[0] if select is not None else None
        self._tensors = tensors if tensors is not None and not reader.tagged else None
        self._through = select.keywords.get("through") if select is not None else None
        if self._tensors is not None:
            row = sum(t[:1].numel() * t.element_size() for t in self._tensors)
            # (at most 256 batches: a small dataset's whole epoch, its views made in one cold pass, not four)
            self._chunk = max(1, min(256, READ_AHEAD_BYTES // max(1, row * sampler.batch_size)))
            # the pass's indices, one tensor: a chunk's are a slice of it (no batches of indices split off
            # and joined again: a quarter of a small model's per-epoch work)
            self._order, self._at = sampler.order(), 0
        else:
            self._indices = iter(sampler)

    def __len__(self) -> int:
        return self._length

    def __iter__(self):
        return self

    def __next__(self):
        if self._tensors is None:
            batch = self._read(next(self._indices))
            return pin_memory(batch) if self._pin else batch
        if not self._ahead:
            at, batch = self._at, self._batch
            indices = self._order[at: at + self._chunk * batch]
            if not len(indices):
                raise StopIteration
            self._at = at + len(indices)
            selected = _select(self._tensors, indices, self._through)
            # (batches of batch_size rows, the last maybe shorter: split's own cut)
            columns = [(t.pin_memory() if self._pin else t).split(batch) for t in selected]
            self._ahead = list(map(list, zip(*columns)))
            self._ahead.reverse()
        return self._ahead.pop()

    def close(self) -> None:
        """End the pass (as ``data.Batches.close`` does; there is no worker to stop): no batch is left."""
        self._indices, self._ahead, self._tensors = iter(()), [], None


def as_is(batch):
    """The collate of a loader without auto-batching over a ``BatchReader``: its batches are made already."""
    return batch
