"""Schemas of the plain sections: ``data``, ``loop``, ``checkpoint``, ``plugins`` and ``sweep``."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from .readonly import ReadOnly


class EvalSample(str, Enum):
    fixed = "fixed"
    fresh = "fresh"
    sequential = "sequential"


@dataclass
class DataConfig(ReadOnly):
    train: Any = MISSING
    """A ``_target_`` building the training dataset: map-style, or an ``IterableDataset`` (then
    ``loop.max_steps`` is required; an epoch ends when its iterator does)."""
    val: Any = None
    """A ``_target_`` building the validation dataset, or ``null`` for no evaluation: the short form of
    ``data.eval.val`` (its metrics are ``val/loss`` ...)."""
    eval: Dict[str, Any] = field(default_factory=dict)
    """Named evaluation sets, each a ``_target_`` building a dataset, evaluated in this order at every
    evaluation; the metrics of set ``<name>`` are ``<name>/loss`` ... (``data.eval.holdout._target_=...``)."""
    test: Any = None
    """A ``_target_`` building the test dataset, evaluated whole once after training, with the weights of
    the best checkpoint when ``checkpoint.keep_best`` keeps one, else the last (and by ``mode=test``); its
    metrics are ``test/loss`` ... The short form of ``data.test_sets.test``."""
    test_sets: Dict[str, Any] = field(default_factory=dict)
    """Named test sets, each a ``_target_`` building a dataset, tested in this order after ``data.test``;
    the metrics of set ``<name>`` are ``<name>/loss`` ... (a name no evaluation set has)."""
    predict: Any = None
    """A ``_target_`` building the dataset ``mode=predict`` writes the model's per-sample outputs for
    (``predictions.jsonl`` in the run directory); its samples need no targets."""
    eval_sample: EvalSample = EvalSample.fixed
    """With ``loop.eval_steps``, which samples an evaluation reads: ``fixed``, the same ones drawn from
    ``seed`` over the whole set at every evaluation (a curve compares like with like); ``fresh``, new ones
    at each evaluation (drawn from ``seed`` and the step, as nanoGPT's ``estimate_loss``); ``sequential``, the
    set's first batches in order (a set whose batches are a sequence: a batchified token stream)."""
    batch_size: int = 32
    """Batch size per process (per step micro-batch when ``loop.grad_accum_steps > 1``)."""
    eval_batch_size: Optional[int] = None
    """Evaluation batch size; defaults to ``batch_size``."""
    num_workers: int = 0
    """Data-loader worker processes."""
    timeout_s: float = 600.0
    """Seconds to wait for a batch from the loader's workers before the run fails naming the worker that
    hung (it is stopped); ``0`` waits forever. Only with ``num_workers > 0``: with 0 the main process loads
    the data itself and nothing can bound a ``__getitem__`` that never returns."""
    shuffle: bool = True
    """Shuffle the training set each epoch (the order is a function of ``seed`` and the epoch)."""
    drop_last: bool = True
    """Drop the last incomplete training batch, so every step sees a full batch."""
    collate_fn: Any = None
    """A ``_target_`` naming the function (other keys: its keyword arguments) or class (built with them)
    that merges samples into a batch; ``null``: torch's default collation."""
    batched_fetch: bool = True
    """Read each batch of a map-style dataset with one indexing operation when the dataset allows it (a
    ``TensorDataset``, or a dataset with ``__getbatch__(indices)``; not with a ``collate_fn``) instead of
    ``__getitem__`` per sample and a collate: the same batches, faster. ``false``: always sample by sample."""
    pin_memory: Optional[bool] = None
    """Page-locked host memory for batches (faster copies to a GPU); ``null``: on when the device is a GPU."""
    persistent_workers: bool = False
    """Keep the loader workers between epochs (needs ``num_workers > 0``; map-style datasets only)."""
    prefetch_factor: Optional[int] = None
    """Batches each worker loads ahead (needs ``num_workers > 0``); ``null``: torch's default (2)."""


@dataclass
class LoopConfig(ReadOnly):
    max_steps: Optional[int] = None
    """Optimizer steps to train (the global step); set exactly one of ``max_steps`` and ``max_epochs``."""
    max_epochs: Optional[int] = None
    """Epochs to train; set exactly one of ``max_steps`` and ``max_epochs``."""
    eval_every: Optional[int] = None
    """Evaluate on ``data.val`` (and every ``data.eval`` set) every this many steps (and after the last
    step); ``null``: only at the end."""
    eval_every_epochs: Optional[int] = None
    """Evaluate at the end of every this many training epochs (and after the last step) instead of by
    steps (``eval_every`` must then be ``null``); ``1``: at each epoch's end. An epoch ends with its last
    whole step (a map-style ``data.train``: its length known in advance)."""
    eval_steps: Optional[int] = None
    """Evaluation batches per evaluation and set; ``null``: the whole set. They hold samples drawn over the
    whole set, or its first batches with ``data.eval_sample=sequential`` (an ``IterableDataset``: always its
    first batches)."""
    eval_at_start: bool = False
    """Also evaluate before the first step (step 0), as nanoGPT does; a resumed run does not again."""
    grad_accum_steps: int = 1
    """Batches whose gradients are accumulated into one optimizer step."""
    log_every: int = 10
    """Log training metrics every this many steps; the only host-device synchronisation of the loop."""
    inference_mode: bool = True
    """Evaluate under ``torch.inference_mode()`` (the batches' loading, forward passes and hooks), which skips
    all autograd bookkeeping; ``false``: under ``torch.no_grad()``. Turn it off for a model whose evaluation
    needs autograd (``torch.enable_grad()`` inside ``forward``, e.g. input gradients), or when tensors made
    during an evaluation are changed in place or saved for backward after it (a sample cache shared with
    ``data.train`` and modified in place, a plugin that keeps outputs to change later): torch refuses
    inference tensors there."""
    collect: List[str] = field(default_factory=list)
    """Evaluation output keys to collect (non-scalar tensors, one row per sample): gathered across steps and
    ranks in dataset order into ``run.eval_outputs`` for ``on_eval_end`` hooks (``csframework.collect``)."""
    collect_max_memory_mb: float = 256.0
    """Collected outputs held in memory past this size spill to files in the run directory (memory-mapped)."""
    collect_save: bool = False
    """Also write the collected outputs to ``eval_outputs/step_<N>.safetensors`` in the run directory."""


class BestMode(str, Enum):
    min = "min"
    max = "max"


@dataclass
class KeepBestConfig:
    monitor: Optional[str] = None
    """A metric name (e.g. ``val/loss``): every evaluation that improves on its best value is saved at once
    (whatever ``every_steps`` says) and kept as the best checkpoint besides ``keep_last``, replacing the
    previous best; a ``train/*`` metric chooses among the checkpoints saved anyway; ``null`` keeps none."""
    mode: BestMode = BestMode.min
    """``min`` or ``max``: which value is best."""


@dataclass
class CheckpointConfig(ReadOnly):
    every_steps: Optional[int] = None
    """Save every this many steps; ``null``: only at the end of each stage."""
    every_epochs: Optional[int] = None
    """Save at the end of every this many training epochs instead of by steps (``every_steps`` must then
    be ``null``), after that epoch's evaluation (``loop.eval_every_epochs``)."""
    keep_last: int = 2
    """How many checkpoints to keep (older ones are deleted after a newer one is complete)."""
    resume: str = "never"
    """``auto`` (continue from the newest checkpoint in the run directory), ``never``, or a path: a
    checkpoint, or a run directory (its newest good checkpoint). ``mode=validate`` evaluates these weights."""
    start_over: bool = False
    """A fresh run (``resume`` not ``auto`` nor a checkpoint of the run there) in a run directory that holds a
    run (checkpoints, ``summary.json``, ``metrics.csv`` or ``events.jsonl``) is refused (exit 2); ``true``
    starts it all the same, after moving the old run's files into ``previous-runs/<date>_<time>/`` there, so
    two runs' records never mix: all or nothing (an entry that cannot be moved is named, nothing is moved)."""
    save_at_end: bool = True
    """Save when a stage ends."""
    keep_best: KeepBestConfig = field(default_factory=KeepBestConfig)
    """Keep the best checkpoint by a metric (``summary.json`` names it as ``best_checkpoint``)."""


@dataclass
class PluginsConfig(ReadOnly):
    enable: List[str] = field(default_factory=list)
    """Module paths of plugin modules (or ``module:attribute``) to register."""
    disable: List[str] = field(default_factory=list)
    """Plugin names to turn off, built-ins included (``validation``, ``logging``, ``progress``, ``metrics``,
    ``eval_metrics``, ``checkpoint``) or entry-point names."""


class Direction(str, Enum):
    minimize = "minimize"
    maximize = "maximize"


@dataclass
class SweepConfig(ReadOnly):
    objective: str = "val/loss"
    """The metric (as named in ``summary.json``) a multirun job returns to a sweeper such as Optuna, and
    that ``sweep.png`` plots against each swept key."""
    direction: Direction = Direction.minimize
    """``minimize`` or ``maximize`` the objective (``hydra/sweeper=optuna`` follows it)."""


def eval_sets(data: DataConfig) -> dict[str, Any]:
    """The evaluation sets of ``data`` by name, in evaluation order: ``data.val`` (as ``val``) first, then
    ``data.eval``'s."""
    sets = {"val": data.val} if data.val is not None else {}
    sets.update((name, spec) for name, spec in data.eval.items() if spec is not None)
    return sets


def eval_set_key(data: DataConfig, name: str) -> str:
    """The config key of evaluation set ``name`` (``data.val`` for its short form)."""
    return "data.val" if name == "val" and data.val is not None else f"data.eval.{name}"


def test_sets(data: DataConfig) -> dict[str, Any]:
    """The test sets of ``data`` by name, in testing order: ``data.test`` (as ``test``) first, then
    ``data.test_sets``'."""
    sets = {"test": data.test} if data.test is not None else {}
    sets.update((name, spec) for name, spec in data.test_sets.items() if spec is not None)
    return sets


def test_metrics(metrics: dict[str, Any], data: DataConfig) -> dict[str, Any]:
    """The metrics of ``data``'s test sets among ``metrics`` (``<set>/...``): measured after a fit's last
    checkpoint, so that no checkpoint holds them, only the run's ``summary.json``."""
    prefixes = tuple(f"{name}/" for name in test_sets(data))
    return {k: v for k, v in metrics.items() if k.startswith(prefixes)}


def test_set_key(data: DataConfig, name: str) -> str:
    """The config key of test set ``name`` (``data.test`` for its short form)."""
    return "data.test" if name == "test" and data.test is not None else f"data.test_sets.{name}"
