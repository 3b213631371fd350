"""Evaluation: one pass over each evaluation set (``data.val``, ``data.eval``) with its hooks, its metrics the
per-sample means of the scalar outputs. The loop calls ``evaluate`` at ``loop.eval_every`` and at a stage's
end; ``Run.validate`` calls it alone; a test set (``csframework.testset``) runs ``evaluate_set`` over all of it.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

from .batched import samples_in
from .collect import Collector
from .rng import rng_state, seed_everything, set_rng_state
from .state import compile_seconds

if TYPE_CHECKING:
    from .protocol import LoopRun


def evaluate(run: LoopRun) -> dict:
    """One pass over each evaluation set (``data.val``, ``data.eval``: at most ``loop.eval_steps`` batches
    each); returns ``<set>/*`` (``val/*``): the mean over samples of every scalar output (each batch's value weighted by its samples, so a short last batch
    counts for what it holds; an output that only some batches return is averaged over those).

    The batches are fetched and evaluated, with their hooks, under ``torch.inference_mode()`` (as in a
    hand-written evaluation loop; ``torch.no_grad()`` with ``loop.inference_mode=false``); the collected
    outputs are assembled, and ``on_eval_epoch_end``/``on_eval_end`` called, outside it.

    Training's random generators are left as the evaluation found them: it draws (random augmentations of
    the validation data, say) from generators seeded by ``seed`` and the step. So how often a run evaluates
    never changes its training, a resumed run trains as the uninterrupted one even where the checkpoint
    was written after an evaluation, and the evaluation of a step is the same in every run.
    """
    training_rng = rng_state()
    seed_everything(((run.stage_config.seed * 1_000_003 + run.global_step) * 1_000_003 + 7) % 2**63)
    started, compiled = time.perf_counter(), compile_seconds(run)
    try:
        metrics = _evaluate(run)
    finally:
        set_rng_state(training_rng)
        # its compilation (the evaluation's own function) counts as compiling, the rest as evaluating
        run.state.eval_seconds += time.perf_counter() - started - (compile_seconds(run) - compiled)
    run.state.last_eval_step = run.global_step
    if run.mode == "fit" and hasattr(run.scheduler, "evaluated"):  # plateau: with what plugins reported too
        run.scheduler.evaluated({**run.metrics, **metrics})
    return metrics


def _evaluate(run: LoopRun) -> dict:
    """``on_eval_start``, a pass over each evaluation set (``_evaluate_set``), ``on_eval_end`` with the
    metrics of all; ``loop.collect`` collects the first set's outputs (``data.val``'s)."""
    hooks, loop = run.hooks, run.stage_config.loop
    was_training = run.module.training
    run.module.eval()
    hooks.on_eval_start(run=run)
    metrics: dict[str, float] = {}
    collector = Collector(run, loop.collect, loop.collect_max_memory_mb) if loop.collect else None
    run.state.eval_reports = metrics  # run.report in the sets' hooks: into their metrics (Run.report)
    try:
        for index, (name, loader) in enumerate(run.eval_loaders.items()):
            run.eval_set = name
            metrics.update(evaluate_set(run, name, loader, collector if index == 0 else None))
        run.eval_set = None
        if collector is not None:
            run.eval_outputs = collector.finish()
            run.log.info("eval_outputs_collected", keys=list(run.eval_outputs), spilled=collector.spilled,
                         rows=len(next(iter(run.eval_outputs.values()), ())),
                         peak_mb=round(collector.peak / 2**20, 3))
            if loop.collect_save and run.rank == 0:
                collector.save(run.eval_outputs, f"step_{run.global_step}.safetensors")
        late: dict[str, float] = {}  # reported in on_eval_end: added after its hooks have read metrics
        run.state.eval_reports = late
        hooks.on_eval_end(run=run, metrics=metrics)
        metrics.update(late)
    finally:
        run.state.eval_reports = None
        run.eval_set = None
        run.eval_outputs = {}
        if collector is not None:
            collector.cleanup()
    run.report(metrics)
    run.module.train(was_training)
    return metrics


def evaluate_set(run: LoopRun, name: str, loader, collector: Collector | None, whole: bool = False) -> dict:
    """One pass over evaluation set ``name`` (at most ``loop.eval_steps`` batches drawn over the whole set,
    ``data.eval_sample``; ``whole``: all, a test set's); returns ``<name>/*``, per-sample means of scalars."""
    hooks, backend, loop = run.hooks, run.backend, run.stage_config.loop
    limit = None if whole else loop.eval_steps
    sampler = getattr(loader, "position", None)
    if sampler is not None and getattr(sampler, "sample", None) is not None:  # fixed: draw 0 at every evaluation; fresh: the step's
        fresh = getattr(run.stage_config.data.eval_sample, "value", run.stage_config.data.eval_sample) == "fresh"
        sampler.set_epoch(run.global_step if fresh else 0)
    hooks.on_eval_epoch_start(run=run, epoch=run.epoch)
    sums: dict[str, torch.Tensor] = {}  # per output: its sum over samples (a batch's value times its samples)
    counts: dict[str, int] = {}  # per output: the samples of the batches that returned it
    carried = run.state.carried  # a stateful model: the set's pass starts from initial_state
    with torch.inference_mode() if loop.inference_mode else torch.no_grad(), \
            carried.evaluating() if carried is not None else contextlib.nullcontext():
        for batch_idx, batch in enumerate(loader):
            if limit is not None and batch_idx >= limit:  # an IterableDataset: its first batches
                break
            batch = backend.to_device(batch)
            hooks.on_eval_batch_start(run=run, batch=batch, batch_idx=batch_idx)
            outputs = backend.eval_batch(run, batch)
            hooks.on_eval_batch_end(run=run, batch=batch, outputs=outputs, batch_idx=batch_idx)
            counted = samples_in(batch)
            samples = counted or 1  # a batch without tensors: its outputs count once each
            for key, value in outputs.items():
                if isinstance(value, torch.Tensor) and value.ndim == 0:
                    if key in sums:  # in place, one op a batch as a hand loop's; add_ upcasts to float32
                        sums[key].add_(value, alpha=samples)
                    else:  # a copy: the sum must not be the output tensor the hooks were given
                        sums[key] = value.to(torch.float32, copy=True).mul_(samples)
                    counts[key] = counts.get(key, 0) + samples
            if collector is not None:
                collector.add(outputs, counted)
    if run.world_size > 1:  # every rank evaluated its shard: average over all of them
        sums, counts = _all_reduce(sums, counts)
    read = torch.stack(list(sums.values())).tolist() if sums else []  # one read of the device for all
    hooks.on_eval_epoch_end(run=run, epoch=run.epoch)
    return {f"{name}/{k}": v / max(counts[k], 1) for k, v in zip(sums, read)}


def _all_reduce(sums: dict, counts: dict) -> tuple[dict, dict]:
    """Sum the per-rank evaluation sums and sample counts over all ranks (one collective)."""
    import torch.distributed as dist

    keys = sorted(sums)
    if not keys:
        return sums, counts
    device = sums[keys[0]].device
    packed = torch.stack([sums[k] for k in keys] + [torch.tensor(float(counts[k]), device=device) for k in keys])
    dist.all_reduce(packed)
    counted = packed[len(keys):].tolist()  # one read of the device for every count
    return {k: packed[i] for i, k in enumerate(keys)}, {k: int(n) for k, n in zip(keys, counted)}
