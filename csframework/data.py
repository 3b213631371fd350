"""Data loaders owned by the framework: a sampler whose order is a function of (seed, epoch) and which can
start in the middle of an epoch, so resume is exact and distributed sharding is explicit."""
from __future__ import annotations

import os
import signal
import sys
import weakref
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .errors import DataTimeoutError
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
    workers), dies with the main process (``_die_with_parent``), and seeds Python, NumPy and torch before each batch from the epoch's seed and the batch's
    first sample: a batch's random augmentations then depend neither on which worker loads it nor on
    where in the epoch a resumed run started, so resume is exact with workers too."""
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent()

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


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when the process that forked it ends, however it ends.
    torch's workers look for their parent only between batches, so one stuck in ``__getitem__`` would
    outlive a main process killed by SIGKILL (or leaving at once on a second stop signal)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != os.getppid():  # not forked by the main process (forkserver)
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return
    if os.getppid() != parent.pid:  # the parent died before prctl: nobody is waiting for this worker
        os._exit(0)


class Batches:
    """One pass over a framework loader: its batches, and the worker processes that load them.

    A batch not delivered within ``data.timeout_s`` raises ``DataTimeoutError`` naming the worker it was
    assigned to (that worker is killed); ``close()`` stops the workers, killing any that do not stop.
    """

    def __init__(self, iterator, loader: "FrameworkLoader"):
        self._iterator, self._loader = iterator, loader
        self._length = len(iterator)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._length

    def __next__(self):
        try:
            return next(self._iterator)
        except RuntimeError as e:
            if not str(e).startswith("DataLoader timed out"):
                raise
            worker_id, pid = self._awaited_worker()
            self.close(hung=pid)
            who = f"worker {worker_id} (pid {pid})" if pid else "a worker"
            raise DataTimeoutError(
                f"{self._loader.role}: loader {who} gave no batch in {self._loader.timeout:g} s "
                f"(data.timeout_s) and was stopped: {type(self._loader.dataset).__name__}.__getitem__ hangs "
                "or is too slow; fix it, or raise data.timeout_s (0 waits forever)") from e

    def _awaited_worker(self) -> tuple[int | None, int | None]:
        """The id and pid of the worker the batch waited for was sent to (torch keeps ``_task_info[idx] =
        (worker_id,)`` until that batch arrives)."""
        it = self._iterator
        task = getattr(it, "_task_info", {}).get(getattr(it, "_rcvd_idx", None), ())
        workers = getattr(it, "_workers", [])
        if len(task) == 1 and 0 <= task[0] < len(workers):
            return task[0], workers[task[0]].pid
        return None, None

    def close(self, hung: int | None = None) -> None:
        """Stop this pass's workers: torch's orderly shutdown, after killing the ``hung`` one (the shutdown
        would wait for it), then kill any worker still running (stuck in ``__getitem__``: torch gives up on
        it after 2 x 5 s, and its SIGTERM does not reach workers, which ignore it)."""
        it, self._iterator = self._iterator, iter(())
        workers = list(getattr(it, "_workers", ()))
        if not workers:
            return
        if hung is not None:
            _forget_worker_pids(it)  # torch's SIGCHLD handler would report the kill as a crash
            for w in workers:
                if w.pid == hung and w.is_alive():
                    w.kill()
        it._shutdown_workers()
        if not getattr(it, "_shutdown", False):  # the interpreter is exiting: multiprocessing stops them
            return
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join(timeout=5)

    def __del__(self):  # a pass dropped unfinished (a break, an error): torch's shutdown alone may leave one
        try:
            self.close()
        except Exception:  # pragma: no cover - nothing to report to during garbage collection
            pass


def _forget_worker_pids(iterator) -> None:
    """Take ``iterator``'s workers off the list torch's SIGCHLD handler checks, so killing one is no error."""
    if getattr(iterator, "_worker_pids_set", False):
        from torch.utils.data import _utils

        _utils.signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False


class FrameworkLoader(DataLoader):
    """A ``DataLoader`` whose passes are ``Batches``; ``close()`` stops the workers of every pass still open
    (``Run.fit`` and ``Run.validate`` call it when they end, whatever ended them)."""

    def __init__(self, *args, role: str = "data", **kwargs):
        super().__init__(*args, **kwargs)
        self.role = role
        self._passes: weakref.WeakSet = weakref.WeakSet()  # a pass nobody holds was shut down by torch

    def __iter__(self) -> Batches:
        batches = Batches(super().__iter__(), self)
        self._passes.add(batches)
        return batches

    def close(self) -> None:
        for batches in list(self._passes):
            batches.close()


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, num_workers: int,
                drop_last: bool, rank: int = 0, world_size: int = 1, pin_memory: bool = False,
                timeout_s: float = 0, role: str = "data") -> FrameworkLoader:
    """A ``FrameworkLoader`` over ``dataset`` with a ``ResumableSampler`` (reachable as ``loader.sampler``).
    ``timeout_s`` bounds the wait for a batch from the workers (``0``: none; no workers: does not apply);
    ``role`` names the loader in errors (``data.train``)."""
    try:
        size = len(dataset)
    except TypeError as e:
        raise TypeError(f"{type(dataset).__name__} is not a map-style dataset with __len__") from e
    sampler = ResumableSampler(size, shuffle, seed, rank, world_size)
    return FrameworkLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                           drop_last=drop_last, pin_memory=pin_memory, worker_init_fn=_seed_worker,
                           generator=torch.Generator().manual_seed(seed), role=role,
                           timeout=timeout_s if num_workers > 0 else 0)


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
