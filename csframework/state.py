"""``RunState``: where a run is. The loop owns it: it is the only writer of the position and the pending
step outputs; the signal handler records a stop request through ``request_stop``; ``Run.load_state_dict``
restores a saved position (the fields ``builtin.checkpoint.schema.POSITION`` names). Plugins read its fields
as ``run.<field>`` (read-only, ``mirror.RecordView``), not through ``run.state``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass
class RunState:
    global_step: int = 0
    """Optimizer steps taken, over all stages."""
    stage_index: int = 0
    """The current stage's index in ``run.stages``."""
    stage_step: int = 0
    """Optimizer steps taken in the current stage."""
    epoch: int = 0
    """The current stage's training epoch (0-based)."""
    batch_in_epoch: int = 0
    """Batches of ``epoch`` already consumed (where a resumed run starts in it)."""
    micro_step: int = 0
    """Batches of the stage consumed (``micro_step % grad_accum_steps == 0``: a step boundary)."""
    last_eval_step: int = -1
    """The global step of the stage's latest evaluation (-1: none yet). Saved, so that a run resumed where
    its stage ended does not evaluate that step again."""
    stop_signal: int | None = None
    """The SIGINT/SIGTERM that asked a running ``fit`` to stop, else ``None``."""
    stopping: bool = False
    """Set at the step boundary where the run stops for ``stop_signal`` (the checkpoint plugin saves then)."""
    stop_reason: str | None = None
    """Set by ``Run.request_stop``: training ends after the current step, as at a normal end."""
    last_log: tuple[float, int, float, float] = (0.0, 0, 0.0, 0.0)
    """At the last training log: ``(time.perf_counter(), global_step, eval_seconds, compile_seconds)``."""
    eval_seconds: float = 0.0
    """Seconds spent evaluating (compilation during evaluation not counted: it is in ``compile_seconds``)."""
    compile_seconds: float = 0.0
    """Seconds the backend spent compiling (tracing) up to the last log or evaluation."""
    train_seconds: float = 0.0
    """Seconds of the training steps logged so far, evaluation and compilation left out."""
    train_steps: int = 0
    """The steps those ``train_seconds`` trained: ``steps_per_sec`` is ``train_steps / train_seconds``."""
    pending: dict[str, list[Any]] = field(default_factory=dict)
    """Per-step scalar outputs since the last log (averaged at ``loop.log_every``): Python numbers where they
    were in host memory, tensors still on their device otherwise (``keep_outputs``; ``window``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The latest value of every reported metric."""
    epoch_end: bool = False
    """The step that just ended is the last whole step of its epoch (known for a map-style ``data.train``);
    ``closes_epochs`` asks it."""
    eval_reports: dict[str, float] | None = None
    """During an evaluation: where ``Run.report`` puts what it is given, so it joins the evaluation's
    metrics (its one ``on_log_metrics`` call, its log line); ``None`` otherwise."""
    carried: Any = None
    """A stateful model's state between batches (``csframework.carried.CarriedState``; saved in checkpoints);
    ``None`` for a model without ``initial_state``."""
    save_due: Callable[[int], bool] | None = None
    """Set by the plugin that saves the run's state at some step ends, through ``Run.set_save_due`` (the
    checkpoint plugin, at ``on_train_start``): whether it saves at the step just taken. The loop asks it at
    every step end before the step's hooks, and at a step it saves reports the metrics not yet logged first
    (``on_log_metrics``, their losses checked), so a plugin never calls back into the loop's flush."""
    save: Callable[[], object] | None = None
    """Given with ``save_due`` (``Run.set_save_due(due, save)``): what the loop calls after the step's
    ``on_train_step_end`` hooks at a step ``save_due`` said yes to, so the plugin needs no per-step hook of its
    own (a hook call at every step, for a save at a few); ``None``: the plugin saves in its own hooks."""
    quiet: frozenset[str] = frozenset()
    """While the loop trains an epoch: the hooks nobody implements (``Hooks.quiet``, asked again when a plugin
    is registered), whose calls the step (``csframework.step``) skips; empty, so every hook is called,
    anywhere else."""

    # -- written by the loop ------------------------------------------------------------------------------
    def enter_stage(self, index: int) -> None:
        """The start of stage ``index``: its counters at zero (the global step goes on)."""
        self.stage_index, self.stage_step = index, 0
        self.epoch = self.batch_in_epoch = self.micro_step = 0
        self.last_eval_step = -1

    def start_batch(self, accum: int) -> bool:
        """A batch is about to run; returns whether it is the last of an optimizer step of ``accum``."""
        self.micro_step += 1
        return self.micro_step % accum == 0

    def end_batch(self, last: bool) -> None:
        """The batch ran (``last``: and with it an optimizer step)."""
        self.batch_in_epoch += 1
        if last:
            self.global_step += 1
            self.stage_step += 1

    def drop_partial_step(self, accum: int) -> int:
        """The stage ends: micro-batches past the last step boundary make no step. Returns how many there
        were; the count goes back to that boundary (the data position stays where it is)."""
        leftover = self.micro_step % accum
        self.micro_step -= leftover
        return leftover

    def closes_epochs(self, every: int | None) -> bool:
        """Whether the step that just ended closed epoch ``every``, ``2 * every``, ... (counted from 1):
        ``loop.eval_every_epochs``, ``checkpoint.every_epochs``; ``False`` when ``every`` is ``None``."""
        return bool(every) and self.epoch_end and (self.epoch + 1) % every == 0  # type: ignore[operator]

    def next_epoch(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = 0

    def keep_outputs(self, outputs: dict) -> None:
        """Keep a step's scalar outputs (0-d tensors) until the next log: as Python numbers where they are in
        host memory (read now, a C call; kept as tensors they would be stacked at the log, a few times dearer,
        and the loop reads a host loss at every step anyway), else as tensors on their device, detached
        (read at the log, all at once: no synchronisation in the step). The hooks that take ``outputs`` get
        them detached from the loop (``step.detached``), only when one is called."""
        pending = self.pending
        for key, value in outputs.items():
            if isinstance(value, Tensor) and not value.ndim:
                value = value.item() if value.is_cpu else value.detach() if value.requires_grad else value
                try:  # (a try costs nothing until it catches: cheaper than asking for the list first)
                    pending[key].append(value)
                except KeyError:  # the output's first step since the last log
                    pending[key] = [value]

    def record(self, reported: dict[str, float]) -> bool:
        """Keep what ``Run.report`` was given in ``metrics``; returns whether it joined an evaluation's metrics
        (``eval_reports``: its hooks report into it), else it is ``on_log_metrics``'s now."""
        self.metrics.update(reported)
        if self.eval_reports is None:
            return False
        self.eval_reports.update(reported)
        return True

    def clear_pending(self) -> None:
        """The pending outputs were logged."""
        self.pending.clear()

    # -- stop requests ------------------------------------------------------------------------------------
    def reset_stop(self) -> None:
        self.stop_signal, self.stopping = None, False

    def request_stop(self, signum: int) -> bool:
        """Record a stop signal; returns ``False`` when one was already recorded (a second signal)."""
        if self.stop_signal is not None:
            return False
        self.stop_signal = signum
        return True

    def stop_after_this_step(self, signum: int | None = None) -> None:
        """The step that just ended is the last (``signum``: the signal the ranks agreed on, under DDP)."""
        if signum is not None:
            self.stop_signal = signum
        self.stopping = True


def window(values: list) -> torch.Tensor:
    """One output's pending values (``RunState.pending``: numbers read on the host, or 0-d tensors on a
    device) as one float32 tensor, in step order."""
    if isinstance(values[0], Tensor):
        return torch.stack(values).float()
    return torch.tensor(values, dtype=torch.float32)


def compile_seconds(run: Any) -> float:
    """Seconds the backend has spent compiling (``backend.compile``) or tracing (CSX) so far, also kept in
    ``run.state.compile_seconds``; 0 for a backend that does not say (``Backend.compile_seconds``)."""
    seconds = getattr(run.backend, "compile_seconds", None)
    run.state.compile_seconds = float(seconds()) if callable(seconds) else 0.0
    return run.state.compile_seconds
