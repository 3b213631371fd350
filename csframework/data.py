"""Data loaders owned by the framework, over ``csframework.sampling``'s orders (a sampler whose order is a
function of (seed, epoch) and which can start in the middle of an epoch, so resume is exact and distributed
sharding is explicit; iterable datasets sharded across ranks and workers the same way), and the one place a
stage's loaders are built (``build_loader``, ``stage_loaders``). A map-style dataset that can index a whole batch at once is
read a batch at a time (``csframework.batched``), in the very batches of the per-sample path."""
from __future__ import annotations

import os
import signal
import sys
import weakref
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .collate import CheckedCollate, build_collate
from .batched import BatchIndices, BatchReader, InProcessPass, as_is, batch_reader
from .config import DataConfig, RunConfig
from .config.sections import eval_set_key, eval_sets, test_set_key, test_sets
from .errors import ConfigError, CsfError, DataTimeoutError, ExitCode
from .rng import seed_everything
from .sampling import MAX_DATASET_LEN, IterableShards, ResumableSampler, WorkerSeeded, dataset_size


def _worker_start(worker_id: int) -> None:
    """Start of a loader worker: it ignores SIGINT/SIGTERM (the main process stops the run, then its
    workers), dies with the main process (``_die_with_parent``), and seeds every generator from torch's
    per-worker seed (``WorkerSeeded`` reseeds before each batch)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent()
    seed_everything(torch.initial_seed() % 2**32)


def from_worker(error: CsfError) -> CsfError:
    """``error`` as raised in a loader worker, with its own message: torch raises a worker's error again in
    this process as ``type(error)("Caught ... Original Traceback ...")``, whose last line is
    ``module.Class: message``. An error raised here, or of a class made of more than a message, is returned
    as it is."""
    kind, text = type(error), str(error)
    message_only = all("__init__" not in vars(c) for c in kind.__mro__  # CsfError's own takes the message only
                       if issubclass(c, CsfError) and c is not CsfError)
    if not (message_only and text.startswith("Caught ") and "Original Traceback" in text):
        return error
    last = text.rstrip().splitlines()[-1]
    prefix = f"{kind.__module__}.{kind.__qualname__}: "
    return kind(last[len(prefix):] if last.startswith(prefix) else last)


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
        os._exit(ExitCode.OK)


class Batches:
    """One pass over a framework loader: its batches, and the worker processes that load them.

    A batch not delivered within ``data.timeout_s`` raises ``DataTimeoutError`` naming the worker it was
    assigned to (that worker is killed); ``close()`` stops the workers, killing any that do not stop.
    """

    def __init__(self, iterator, loader: "FrameworkLoader"):
        self._iterator, self._loader = iterator, loader
        self._length: int | None
        try:
            self._length = len(iterator)
        except TypeError:  # an IterableDataset: its length is known when its iterator ends
            self._length = None

    def __iter__(self):
        return self

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("a pass over an IterableDataset has no length")
        return self._length

    def __next__(self):
        try:
            return next(self._iterator)
        except CsfError as e:  # ours, from a worker: torch raised it again with the worker's traceback as message
            raise from_worker(e) from e
        except RuntimeError as e:
            if not str(e).startswith("DataLoader timed out"):
                raise
            worker_id, pid = self._awaited_worker()
            self.close(hung=pid)
            who = f"worker {worker_id} (pid {pid})" if pid else "a worker"
            raise DataTimeoutError(
                f"{self._loader.role}: loader {who} gave no batch in {self._loader.timeout:g} s "
                f"(data.timeout_s) and was stopped: {self._loader.reader()} hangs "
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
        if getattr(self._loader, "_iterator", None) is it:  # persistent workers: the next pass starts anew
            self._loader._iterator = None
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
        if self._loader.persistent_workers:  # the loader keeps them for its next pass; close() stops them
            return
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
    (``Run.fit`` and ``Run.validate`` call it when they end, whatever ended them).

    ``position`` is what ``set_epoch(epoch, start)`` places at a sample of an epoch (the ``ResumableSampler``
    or the ``IterableShards``), ``samples_per_batch`` the batch size: ``loader.batch_size`` is ``None`` on
    the batched fast path (``csframework.batched``), whose sampler yields whole batches."""

    def __init__(self, *args, role: str = "data", position, samples_per_batch: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.role, self.position, self.samples_per_batch = role, position, samples_per_batch
        self._passes: weakref.WeakSet = weakref.WeakSet()  # a pass nobody holds was shut down by torch

    def __iter__(self) -> Batches | InProcessPass:  # type: ignore[override]  # a pass, not torch's iterator
        batches: Batches | InProcessPass
        sampler = self.sampler
        if isinstance(self.dataset, BatchReader) and isinstance(sampler, BatchIndices) and self.num_workers == 0:
            # pinned as the DataLoader pins: where CUDA is (pin_memory asks for pinning that needs it); no
            # worker to wait for, so no Batches around it (a frame less for every batch)
            pin = self.pin_memory and torch.cuda.is_available()
            batches = InProcessPass(sampler, self.dataset, pin)
        else:
            batches = Batches(super().__iter__(), self)
        self._passes.add(batches)
        return batches

    def close(self) -> None:
        for batches in list(self._passes):
            batches.close()
        if getattr(self, "_iterator", None) is not None:  # persistent workers outlive their passes
            Batches(self._iterator, self).close()

    def reader(self) -> str:
        """What a worker runs for a batch, for error messages: ``Dataset.__getitem__`` or ``.__iter__``."""
        dataset = self.dataset
        if isinstance(dataset, BatchReader):
            return dataset.reader()
        if isinstance(dataset, (IterableShards, WorkerSeeded)):
            dataset = dataset.dataset
        return f"{type(dataset).__name__}.{'__iter__' if isinstance(dataset, IterableDataset) else '__getitem__'}"


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, num_workers: int,
                drop_last: bool, rank: int = 0, world_size: int = 1, pin_memory: bool = False,
                collate_fn=None, persistent_workers: bool = False, prefetch_factor: int | None = None,
                timeout_s: float = 0, role: str = "data", pad: bool = False,
                batched_fetch: bool = True, sample: int | None = None, first: bool = False) -> FrameworkLoader:
    """A ``FrameworkLoader`` over ``dataset``: a map-style one through a ``ResumableSampler``
    (``loader.position``), an ``IterableDataset`` through ``IterableShards`` (``loader.dataset``, and its
    ``position``). ``timeout_s`` bounds the wait for a batch from the workers (``0``: none; no workers: does
    not apply); ``role`` names the loader in errors (``data.train``); ``pad``: see ``ResumableSampler``.
    ``batched_fetch``: read each batch of a map-style dataset that allows it in one operation
    (``csframework.batched``; never with a ``collate_fn``), the same batches as sample by sample.
    ``sample``: a map-style dataset's passes read that many samples drawn over it, or its first ones with
    ``first`` (``ResumableSampler``)."""
    tagged = num_workers > 0
    if collate_fn is not None:
        collate_fn = CheckedCollate(collate_fn, role)
    common: dict[str, Any] = dict(num_workers=num_workers, pin_memory=pin_memory, worker_init_fn=_worker_start,
                  prefetch_factor=prefetch_factor, persistent_workers=persistent_workers and tagged,
                  generator=torch.Generator().manual_seed(seed), role=role, samples_per_batch=batch_size,
                  timeout=timeout_s if tagged else 0)
    if isinstance(dataset, IterableDataset):
        if persistent_workers:
            raise ConfigError("data.persistent_workers: an IterableDataset's workers learn the epoch and the "
                              "resume position when they start, so they cannot persist; set it to false")
        shards = IterableShards(dataset, batch_size, seed, rank, world_size)
        return FrameworkLoader(shards, batch_size=batch_size, drop_last=drop_last, collate_fn=collate_fn,
                               position=shards, **common)
    size = dataset_size(dataset, role)
    sampler = ResumableSampler(size, shuffle, seed, rank, world_size, tag_epoch=tagged, pad=pad, sample=sample,
                               first=first)
    read = batch_reader(dataset) if batched_fetch and collate_fn is None else None
    if read is not None:  # no auto-batching: the sampler yields whole batches, the dataset reads them
        return FrameworkLoader(BatchReader(dataset, read, seed, tagged, role), batch_size=None, collate_fn=as_is,
                               sampler=BatchIndices(sampler, batch_size, drop_last, as_lists=tagged),
                               position=sampler, **common)
    if tagged:
        dataset = WorkerSeeded(dataset, seed)
    return FrameworkLoader(dataset, sampler=sampler, batch_size=batch_size, drop_last=drop_last,
                           collate_fn=collate_fn, position=sampler, **common)


def is_iterable(loader: DataLoader) -> bool:
    return isinstance(loader.dataset, IterableShards)


def epoch_batches(loader: FrameworkLoader, epoch: int, start_batch: int = 0) -> Iterator[Any]:
    """Iterate the batches of ``epoch`` starting after ``start_batch`` batches."""
    position = loader.position
    position.set_epoch(epoch, start_batch * loader.samples_per_batch)
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


# -- a stage's loaders ----------------------------------------------------------------------------------------
def build_loader(data: DataConfig, role: str, seed: int, *, rank: int = 0, world_size: int = 1,
                 device_type: str = "CPU", eval_steps: int | None = None) -> tuple[FrameworkLoader, Any]:
    """The loader of one set of ``data`` and its dataset: ``role`` ``"train"`` (``data.train``, shuffled and
    cut as ``data`` says) or an evaluation set's name (``val`` ...: in order, padded, ``eval_steps`` batches
    per process of samples drawn over it, or the first ones: ``data.eval_sample``). Every setting of ``data``
    applies (workers, their timeout, ``pin_memory``, prefetching); the one place a loader is assembled, for
    the run and for the ``csframework-cerebras`` input workers."""
    from .targets import build

    pin = data.pin_memory if data.pin_memory is not None else device_type == "GPU"
    options: dict[str, Any] = dict(
        seed=seed, num_workers=data.num_workers, rank=rank, world_size=world_size, pin_memory=pin,
        collate_fn=build_collate(data.collate_fn), timeout_s=data.timeout_s, persistent_workers=data.persistent_workers,
        prefetch_factor=data.prefetch_factor, batched_fetch=data.batched_fetch)
    if role == "train":
        dataset = build(data.train, "data.train")
        return make_loader(dataset, data.batch_size, shuffle=data.shuffle, drop_last=data.drop_last,
                           role="data.train", **options), dataset
    spec, key = set_spec(data, role)
    dataset = build(spec, key)
    batch_size = data.eval_batch_size or data.batch_size
    sample = eval_steps * batch_size * world_size if eval_steps else None
    first = getattr(data.eval_sample, "value", data.eval_sample) == "sequential"
    return make_loader(dataset, batch_size, shuffle=False, drop_last=False, role=key, pad=True, sample=sample,
                       first=first, **options), dataset


#: The role of ``data.predict``'s loader (no set's name has a '/').
PREDICT = "/predict"
#: ``mode=predict`` without ``data.predict`` (the schema's ``None``: on the command line it takes the ``+``)
NO_PREDICT_SET = ("data.predict: mode=predict needs a dataset to predict; set it in your data config "
                  "(predict: {_target_: ...}) or on the command line with +data.predict._target_=<dataset class> "
                  "(its arguments +data.predict.<name>=...)")


def set_spec(data: DataConfig, role: str) -> tuple[Any, str]:
    """The ``_target_`` spec and config key of the set ``role`` names: an evaluation set, a test set
    (``data.test`` ...) or ``PREDICT``; a ``ConfigError`` naming the key when there is none."""
    if role == PREDICT:
        if data.predict is None:
            raise ConfigError(NO_PREDICT_SET)
        return data.predict, "data.predict"
    for sets, key_of in ((eval_sets(data), eval_set_key), (test_sets(data), test_set_key)):
        if sets.get(role) is not None:
            return sets[role], key_of(data, role)
    raise ConfigError(f"{eval_set_key(data, role)}: no such evaluation set "
                      f"(sets: {', '.join(eval_sets(data)) or 'none'}); set it")


def stage_loaders(cfg: RunConfig, rank: int = 0, world_size: int = 1
                  ) -> tuple[FrameworkLoader, dict[str, FrameworkLoader]]:
    """A stage's training loader and its evaluation sets' loaders by name (``data.val`` as ``val`` first),
    refusing with a ``ConfigError`` naming the setting what would train or evaluate nothing."""
    data, loop = cfg.data, cfg.loop
    train_loader, train = build_loader(data, "train", cfg.seed, rank=rank, world_size=world_size,
                                       device_type=cfg.device.type)
    check_train_loader(train_loader, train, cfg)
    loaders = {}
    for name in eval_sets(data):
        loader, dataset = build_loader(data, name, cfg.seed, rank=rank, world_size=world_size,
                                       device_type=cfg.device.type, eval_steps=loop.eval_steps)
        if not is_iterable(loader) and len(dataset) == 0:
            key = eval_set_key(data, name)
            raise ConfigError(f"{key}: the dataset is empty ({type(dataset).__name__} has no sample); "
                              f"check it, or set {key}=null to train without evaluating it")
        loaders[name] = loader
    return train_loader, loaders


def check_train_loader(loader: FrameworkLoader, dataset: Any, cfg: RunConfig) -> None:
    """Refuse a training loader that makes no step: an empty set, a batch larger than the set with
    ``drop_last``, fewer batches than a step takes; an ``IterableDataset`` without ``loop.max_steps``."""
    data, loop = cfg.data, cfg.loop
    if is_iterable(loader):
        if loop.max_steps is None:
            raise ConfigError("loop.max_steps: data.train is an IterableDataset, which has no length to count "
                              "epochs in advance; set loop.max_steps (an epoch ends when its iterator does)")
        for key, value, instead in (("loop.eval_every_epochs", loop.eval_every_epochs, "loop.eval_every"),
                                    ("checkpoint.every_epochs", cfg.checkpoint.every_epochs, "checkpoint.every_steps")):
            if value is not None:
                raise ConfigError(f"{key}: data.train is an IterableDataset, whose epochs have no length known in "
                                  f"advance (the end of an epoch is not known at its last step); use {instead}")
    elif len(dataset) == 0:
        raise ConfigError(f"data.train: the dataset is empty ({type(dataset).__name__} has no sample); check it")
    elif len(loader) == 0:
        raise ConfigError(f"data.batch_size: {data.batch_size} is larger than the training set "
                          f"({len(dataset)} samples, {len(loader.position)} per process) with drop_last; lower it")
    elif loop.max_steps is None and (loop.max_epochs or 0) * len(loader) < loop.grad_accum_steps:
        raise ConfigError(f"loop.grad_accum_steps: a step takes {loop.grad_accum_steps} batches, and "
                          f"{loop.max_epochs} epoch(s) of {len(loader)} batch(es) make no step; "
                          "lower it, or raise loop.max_epochs")


def total_steps(cfg: RunConfig, train_loader: FrameworkLoader) -> int:
    """Optimizer steps of a stage: ``loop.max_steps``, or ``max_epochs`` x steps per epoch."""
    loop = cfg.loop
    if loop.max_steps is not None:
        return loop.max_steps
    # a step may span two epochs of a stage (only its end drops a partial step: loop._drop_partial_step)
    return (loop.max_epochs or 0) * len(train_loader) // loop.grad_accum_steps


__all__ = ["MAX_DATASET_LEN", "FrameworkLoader", "ResumableSampler", "build_collate", "build_loader",
           "epoch_batches", "is_iterable", "make_loader", "move_to", "stage_loaders", "total_steps"]
