"""The training loop. It only computes and fires hooks; features live in plugins (evaluation: ``evaluation``).

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

import math
import time
from itertools import chain
from math import isfinite
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .data import epoch_batches, is_iterable
from .errors import ConfigError
from .evaluation import evaluate
from .finite import check_finite
from .signals import Interrupted
from .state import compile_seconds, window
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
    ``on_train_step_end`` for the step, the plugin saves (``RunState.save``: the checkpoint plugin, after
    that evaluation, so a checkpoint holds the metrics of its step's evaluation), and a stopped run ends
    (``Interrupted``).
    ``parts``: ``(run.state, run.hooks, run.backend, run.scheduler, loop.log_every, loop.eval_every,
    loop.eval_every_epochs, whether the backend's world_size is 1)``, read by the caller once an epoch;
    ``quiet``: hooks not to call (nobody implements them: ``Hooks.quiet``)."""
    state, hooks, backend, scheduler, log_every, eval_every, eval_every_epochs, alone = parts
    scheduler.step()
    state.keep_outputs(outputs)
    # a loss in host memory was read as it was kept: checked now, so that a CPU or CSX-emulated run stops at
    # this very step (docs/durability.md; not an error under dynamic scaling); a device's loss waits for the
    # next boundary
    losses = state.pending.get("loss")
    if losses and not isinstance(losses[-1], Tensor) and not isfinite(losses[-1]):
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
    saving = state.save_due is not None and state.save_due(state.global_step)
    if saving:
        log_train_metrics(run)  # a checkpoint holds the metrics of the steps before it, their losses checked
    if "on_train_batch_end" not in quiet or "on_train_step_end" not in quiet:
        outputs = detached(outputs)  # (only for hooks that are called: a detach costs a small model's step)
        if "on_train_batch_end" not in quiet:
            hooks.on_train_batch_end(run=run, batch=batch, outputs=outputs, batch_idx=batch_idx)
        if "on_train_step_end" not in quiet:
            hooks.on_train_step_end(run=run, step=state.global_step, outputs=outputs)
    if saving and state.save is not None:  # (Run.set_save_due's save: after every plugin's step end)
        state.save()
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
        values = {k: window(v) for k, v in pending.items()}
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


def window_means(windows: list[list]) -> list[float]:
    """The mean of each output's pending values (``RunState.pending``), read at once: of numbers read on the
    host, the exact mean (``math.fsum``, in Python: a torch reduction of a few dozen numbers costs a log more
    than the rest of its arithmetic); of tensors, their float32 mean, one ``stack``, ``mean`` and read (one
    synchronisation) when every window has a value of every step on one device, else each reduced on its own."""
    if not any(isinstance(w[0], Tensor) for w in windows):
        return [_exact_mean(w) for w in windows]
    steps, device = len(windows[0]), windows[0][0].device if isinstance(windows[0][0], Tensor) else None
    if all(len(w) == steps and isinstance(w[0], Tensor) and w[0].device == device for w in windows):
        return torch.stack(list(chain.from_iterable(windows))).view(len(windows), steps).float().mean(1).tolist()
    return torch.stack([window(w).mean().to(device or "cpu") for w in windows]).tolist()


def _exact_mean(numbers: list) -> float:
    """The mean of ``numbers`` rounded once; NaN when one is not finite (``fsum`` refuses ``inf - inf``); of
    complex numbers (a complex 0-d output's ``.item()``), the float32 mean of their real parts, as before."""
    try:
        return math.fsum(numbers) / len(numbers)
    except (ValueError, OverflowError):
        return math.nan
    except TypeError:
        return float(torch.tensor(numbers).float().mean())
