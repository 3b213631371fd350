"""The training and evaluation loop. It only computes and fires hooks; features live in plugins.

The loop owns ``run.state`` (``RunState``): it alone advances the position and keeps the per-step outputs.
The steps themselves are the backend's (``csframework.step``: one sequence for every backend); the loop
steps the learning-rate schedule after each. Nothing in a step reads a value from the device: the step's
scalar outputs are kept there until a boundary, ``loop.log_every`` (where they are averaged and read at
once, their losses checked), an evaluation (the losses checked first) or a checkpoint; a plugin that reads
a value itself (``float(outputs["loss"])``) synchronises then. See ``hookspecs`` for the order of hooks. A
loss in host memory (CPU, the CSX emulator) is also checked at every step, which costs no synchronisation
there (a read of 1-2 us), so a run stops at the step whose loss is not finite.
"""
from __future__ import annotations

import contextlib
import math
import time
from itertools import chain
from math import isfinite
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .batched import samples_in
from .collect import Collector
from .data import epoch_batches, is_iterable
from .errors import ConfigError
from .finite import check_finite
from .rng import rng_state, seed_everything, set_rng_state
from .signals import Interrupted
from .step import detached

if TYPE_CHECKING:
    from .protocol import LoopRun
    from .state import RunState


def fit(run: LoopRun) -> str:
    """Train every stage from ``run``'s position (``run.stage_index``, set on resume) to the end; returns
    the run's final status (``completed``, or a backend's dry run's: CSX ``compiled`` / ``validated``)."""
    for index in range(run.stage_index, len(run.stages)):
        if run.stop_reason is not None:  # run.request_stop: later stages are skipped
            break
        if index != run.stage_index:
            run.enter_stage(index)
        if run.backend.dry_run:  # e.g. CSX compile_only: prepare the stage, train nothing
            run.backend.dry_stage(run)
        else:
            train_stage(run)
    return run.backend.dry_run or "completed"


def _stage_done(state: RunState, loop) -> bool:
    """Whether the stage (its ``loop`` settings) has taken its ``max_steps`` steps or ``max_epochs`` epochs."""
    if loop.max_steps is not None:
        return state.stage_step >= loop.max_steps
    return state.epoch >= loop.max_epochs


def train_stage(run: LoopRun) -> None:
    """Train the current stage until ``loop.max_steps`` steps or ``loop.max_epochs`` epochs."""
    hooks, loop, state = run.hooks, run.stage_config.loop, run.state
    state.clear_pending()
    state.last_log = (time.perf_counter(), run.global_step, state.eval_seconds, compile_seconds(run))
    run.module.train()
    hooks.on_train_start(run=run)
    if loop.eval_at_start and run.val_loader is not None and state.stage_step == 0 \
            and state.last_eval_step != run.global_step:  # not again after a resume, or a stage's final one
        evaluate(run)
    while not _stage_done(state, loop) and state.stop_reason is None:
        epoch = state.epoch
        hooks.on_train_epoch_start(run=run, epoch=epoch)
        ran_out = train_epoch(run, epoch)
        if ran_out:
            if state.batch_in_epoch == 0:  # an (iterable) dataset that yields nothing would loop forever
                raise ConfigError(f"data.train: epoch {epoch} yielded no batch (fewer samples than "
                                  "data.batch_size x the number of processes?); check the dataset")
            run.scheduler.epoch_end()  # a schedule with optimizer.schedule.interval=epoch steps here
        hooks.on_train_epoch_end(run=run, epoch=epoch)
        if ran_out:
            state.next_epoch()
    _drop_partial_step(run, loop.grad_accum_steps)
    log_train_metrics(run)
    if run.val_loader is not None and state.last_eval_step != run.global_step:  # not again after a resume
        evaluate(run)
    hooks.on_train_end(run=run)


def train_epoch(run: LoopRun, epoch: int) -> bool:
    """Train on the batches of ``epoch`` from the run's position until the stage is done or a stop is
    requested (``False``), or the epoch runs out of batches (``True``)."""
    # read once an epoch, not at every step (each ``run.x`` is a property call, each setting an attribute
    # read); the position is read from ``state``
    hooks, backend, loop, state = run.hooks, run.backend, run.stage_config.loop, run.state
    parts = (state, hooks, backend, run.scheduler, loop.log_every, loop.eval_every, loop.eval_every_epochs,
             backend.world_size == 1)  # end_step's
    accum = loop.grad_accum_steps
    max_steps = math.inf if loop.max_steps is None else loop.max_steps
    if state.carried is not None and state.batch_in_epoch == 0:  # an epoch starts from initial_state
        state.carried.reset()
    start = state.batch_in_epoch
    batches: Any = epoch_batches(run.train_loader, epoch, start)  # a map-style pass has a len
    # the positions in the epoch after which no whole step is left in it (a map-style pass's length is known)
    # and in the stage (its last epoch, with max_epochs): a step ending past them is the epoch's / stage's last
    epoch_ends = math.inf if is_iterable(run.train_loader) else start + len(batches) - accum
    ends_at = _stage_end_in(batches, epoch, start, loop)
    stage_ends = math.inf if ends_at is None else ends_at - accum
    # the hooks nobody implements are not called (here, and in the step: state.quiet), until a plugin is
    # (un)registered (the generation moves)
    pm: Any = hooks.pm  # an ObservedManager (with a generation) whenever quiet() names one
    generation, quiet = hooks.quiet()
    state.quiet = quiet
    try:
        for batch in batches:
            if generation is not None and pm.generation != generation:
                generation, quiet = hooks.quiet()
                state.quiet = quiet
            batch = backend.to_device(batch)
            if "on_train_batch_start" not in quiet:
                hooks.on_train_batch_start(run=run, batch=batch, batch_idx=state.batch_in_epoch)
            last = state.start_batch(accum)
            outputs = backend.train_batch(run, batch, last)
            state.end_batch(last)
            position = state.batch_in_epoch  # this batch's index + 1
            if not last:
                if "on_train_batch_end" not in quiet:  # (the step's outputs are detached in end_step)
                    hooks.on_train_batch_end(run=run, batch=batch, outputs=detached(outputs), batch_idx=position - 1)
                continue
            # the stage is done once its steps are taken (with max_epochs: not inside an epoch, which
            # train_stage only starts when the stage is not done)
            done = state.stage_step >= max_steps
            state.epoch_end = position > epoch_ends
            # the stage's last step: its steps are taken, or its last epoch has no full step left (the batches
            # after it, if any, are micro-batches that _drop_partial_step drops)
            end_step(run, parts, batch, outputs, position - 1, done or position > stage_ends, quiet)
            if done or state.stop_reason is not None:
                return False
    finally:  # outside the epoch's steps every hook is called (a step traced or run elsewhere)
        state.quiet = frozenset()
    return True


def _stage_end_in(batches, epoch: int, start: int, loop) -> int | None:
    """The batch of ``epoch`` its pass ``batches`` (from batch ``start``) ends at, when the stage ends with
    that epoch (``loop.max_epochs``, which needs a dataset with a length); else ``None``."""
    if loop.max_steps is not None or epoch != loop.max_epochs - 1:
        return None
    return start + len(batches)


def finished(run: LoopRun) -> bool:
    """Whether the run is at its end: its last stage has taken its steps, or ``request_stop`` ended it (the
    plugins' settings unchanged since), and, with ``data.val``, evaluated the last one (so a run resumed from
    the checkpoint of its last step has nothing left to do)."""
    state = run.state
    if state.global_step == 0 or (run.val_loader is not None and state.last_eval_step != state.global_step):
        return False
    if state.stop_reason is not None:  # resumed at the step where request_stop ended it (Run.load_state_dict)
        return True
    if state.stage_index != len(run.stages) - 1:
        return False
    # max_epochs: every full step of the stage's epochs taken (the rest of the last epoch makes no step)
    return _stage_done(state, run.stage_config.loop) or state.stage_step >= run.total_steps(run.stage_config)


def end_step(run: LoopRun, parts: tuple, batch, outputs: dict, batch_idx: int, final: bool,
             quiet: frozenset[str]) -> None:
    """The end of an optimizer step (its last micro-batch ``batch`` gave ``outputs``, as the backend returned
    them; ``final``: the stage's last step, as is a step after ``run.request_stop``), in this order: the
    schedule advances, the step's outputs are detached and their scalars kept for the next log, a loss not
    finite on the host stops the run, the metrics are logged (``loop.log_every``, and the final step), the
    evaluation runs (``loop.eval_every`` or ``eval_every_epochs``, and the final step;
    the losses since the last log are checked first, so a non-finite one stops the run before it is
    evaluated), a stop signal makes this step the last, at a step a plugin saves (``RunState.save_due``)
    the metrics not yet logged are reported, ``on_train_batch_end`` fires for the batch and
    ``on_train_step_end`` for the step (the checkpoint plugin saves there, after that evaluation: a
    checkpoint holds the metrics of its step's evaluation), and a stopped run ends (``Interrupted``).
    ``parts``: ``(run.state, run.hooks, run.backend, run.scheduler, loop.log_every, loop.eval_every,
    loop.eval_every_epochs, whether the backend's world_size is 1)``, read by the caller once an epoch;
    ``quiet``: hooks not to call (nobody implements them: ``Hooks.quiet``)."""
    state, hooks, backend, scheduler, log_every, eval_every, eval_every_epochs, alone = parts
    scheduler.step()
    outputs = state.keep_outputs(outputs)
    loss = outputs.get("loss")
    # on the host a read (``bool(loss.isfinite())`` would cost a kernel) of 1-2 us, one dispatcher call: kept,
    # so that a CPU or CSX-emulated run stops at this very step (docs/durability.md; not an error under
    # dynamic scaling); a device's loss waits for the next boundary
    if isinstance(loss, Tensor) and loss.is_cpu and not isfinite(loss.item()):
        check_finite(run)
    final = final or state.stop_reason is not None
    if final or state.global_step % log_every == 0:
        log_train_metrics(run)
    # (eval_every_epochs asked first: no call of closes_epochs at every step without it)
    due = (eval_every_epochs and state.closes_epochs(eval_every_epochs)) or (
        eval_every and state.stage_step % eval_every == 0)
    if (final or due) and run.val_loader is not None:
        if state.pending.get("loss"):  # the evaluation synchronises anyway: a loss gone non-finite stops it here
            check_finite(run)
        evaluate(run)
    # SIGINT/SIGTERM (under DDP: on any rank, asked only when there is another rank): this step is the last
    signum = state.stop_signal if alone else backend.any_rank_signal(state.stop_signal)
    if signum is not None:
        state.stop_after_this_step(signum)
    if state.save_due is not None and state.save_due(state.global_step):
        log_train_metrics(run)  # a checkpoint holds the metrics of the steps before it, their losses checked
    if "on_train_batch_end" not in quiet:
        hooks.on_train_batch_end(run=run, batch=batch, outputs=outputs, batch_idx=batch_idx)
    if "on_train_step_end" not in quiet:
        hooks.on_train_step_end(run=run, step=state.global_step, outputs=outputs)
    if state.stopping and state.stop_signal is not None:  # set together (RunState.stop_after_this_step)
        raise Interrupted(state.stop_signal, state.global_step)


def _drop_partial_step(run: LoopRun, accum: int) -> None:
    """A stage ends at a step boundary: the gradients of micro-batches after the last step (``max_epochs``
    with epochs that ``grad_accum_steps`` does not divide) are dropped, not carried into the next stage or
    a later run (a checkpoint does not hold gradients, so a resumed run could not carry them)."""
    leftover = run.state.drop_partial_step(accum)
    if leftover:
        run.optimizer.zero_grad(set_to_none=True)
        run.log.warning("partial_step_dropped", micro_batches=leftover, grad_accum_steps=accum,
                        problem=f"the stage ended {leftover} micro-batch(es) into a step of {accum}: their "
                                "gradients are dropped; make loop.grad_accum_steps divide the batches of an epoch "
                                "to use every batch")


def log_train_metrics(run: LoopRun) -> None:
    """Average the per-step values gathered since the last log (one synchronisation) and report them."""
    state, pending = run.state, run.state.pending
    if not pending.get("loss"):
        return
    keys = list(pending)  # in the order the step gave them: metrics.csv's rows, the events' fields
    means = window_means(list(pending.values()))
    if not math.isfinite(means[keys.index("loss")]):  # a loss in the window is not finite (or their sum overflowed)
        values = {k: torch.stack(v).float() for k, v in pending.items()}
        finite = check_finite(run, values["loss"])
        if finite is not None:  # dynamic loss scaling skipped some steps: average the others
            values = {k: v[finite] if len(v) == len(finite) else v for k, v in values.items()}
        means = [float(values[k].mean()) for k in keys]
    elif run.stage_config.precision.loss_scaling == "dynamic":
        check_finite(run, torch.zeros(0))  # every loss was finite; the loss scale's floor is checked at each log
    metrics = dict(zip(map("train/{}".format, keys), means))  # (the names made in C)
    metrics["lr"] = float(run.optimizer.param_groups[0]["lr"])
    metrics["steps_per_sec"] = _training_rate(state, compile_seconds(run))
    state.clear_pending()
    run.report(metrics)


def _training_rate(state: RunState, compiled: float) -> float:
    """Steps per second of training since the last log, the time spent evaluating and compiling (``compiled``:
    seconds so far) in between left out: a log after an evaluation or the first compiled step reads the same
    rate as any other, as ``summary.json``'s (the whole fit's, from the same ``RunState.train_seconds``)."""
    now, step = time.perf_counter(), state.global_step
    since, step_before, evaluated, compiled_before = state.last_log
    busy = max(now - since - (state.eval_seconds - evaluated) - (compiled - compiled_before), 1e-9)
    state.train_seconds += busy
    state.train_steps += step - step_before
    state.last_log = (now, step, state.eval_seconds, compiled)
    return (step - step_before) / busy


def compile_seconds(run: LoopRun) -> float:
    """Seconds the backend has spent compiling (``backend.compile``) or tracing (CSX) so far, also kept in
    ``run.state.compile_seconds``; 0 for a backend that does not say (``Backend.compile_seconds``)."""
    seconds = getattr(run.backend, "compile_seconds", None)
    run.state.compile_seconds = float(seconds()) if callable(seconds) else 0.0
    return run.state.compile_seconds


def window_means(windows: list[list[torch.Tensor]]) -> list[float]:
    """The float32 mean of each list of 0-d tensors, read from the device at once (one synchronisation).

    When every list has a value of every step on one device (the usual case) they are stacked together,
    one ``stack``, ``mean`` and read for them all; else each list is reduced on its own first."""
    device = windows[0][0].device  # (lengths and devices compared in C: no generator, no Python pass)
    if len(set(map(len, windows))) == 1 and set(map(attrgetter("device"), map(itemgetter(0), windows))) == {device}:
        return torch.stack(list(chain.from_iterable(windows))).view(len(windows), -1).float().mean(1).tolist()
    return torch.stack([torch.stack(w).float().mean().to(device) for w in windows]).tolist()


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
            metrics.update(_evaluate_set(run, name, loader, collector if index == 0 else None))
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


def _evaluate_set(run: LoopRun, name: str, loader, collector: Collector | None, whole: bool = False) -> dict:
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
