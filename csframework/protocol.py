"""The contracts on the lowest floor: what a hook may read and call on a run (``RunProtocol``), what the
loop, the step and the backends may (``LoopRun``: that and the loop's record, ``run.state``), what the loop
and the run call on a backend (``Backend``), and how a plugin supplies a backend (``BackendSpec``).

Hooks (``hookspecs``), the step sequence (``step``), the loop and the backends are typed against these, not
against ``run.Run``, so nothing below ``run.py`` imports it, not even for the type checker; ``run.Run``
satisfies ``LoopRun`` (checked by the type checker in ``run.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .config import RunConfig
    from .files import SafeDir
    from .hooks import Hooks
    from .state import RunState


class RunProtocol(Protocol):
    """A run as plugins see it (``run.Run`` is the implementation): what a hook may read and call on ``run``,
    each piece under one name. The loop's record (``run.state``) and the current stage (``run.current``) are
    read through ``run.<name>`` here, not through their holders."""

    config: RunConfig
    """The run's config (read-only once validated)."""
    hooks: Hooks
    """Calls hooks: ``run.hooks.on_x(run=run, ...)``."""
    model: torch.nn.Module
    """The model (unwrapped)."""
    optimizer: torch.optim.Optimizer
    """The current stage's optimizer (a backend's ``attach`` may replace it)."""
    scheduler: Any
    """The learning-rate schedule (``csframework.schedule``; a backend's ``attach`` may replace it)."""
    log: Any
    """A bound structlog logger: ``run.log.info(<event name>, key=value)`` lands in ``events.jsonl``."""
    output_dir: Path
    run_id: str
    device_type: str
    """``"CPU"``, ``"GPU"``, ``"CSX"``, or a plugin's device type."""
    mode: str
    """``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``."""
    status: str
    summary_extra: dict[str, Any]
    """Entries a plugin adds to ``summary.json``."""
    already_complete: bool
    """``fit`` resumed the run at its end (``checkpoint.resume``): nothing is trained, no checkpoint written."""
    error_file: Path | None
    """The run directory's ``error.txt``, once the user's code (a forward, a dataset, a plugin) failed the run."""
    eval_outputs: dict[str, torch.Tensor]
    """During ``on_eval_end``: the outputs named in ``loop.collect`` (name -> CPU tensor in dataset order;
    complete on rank 0, empty on the other ranks)."""
    stages: list[tuple[str, RunConfig]]
    eval_set: str | None
    """During an evaluation, the name of the set being evaluated (its batch and epoch hooks); else ``None``."""

    @property
    def backend(self) -> Backend:
        """The current stage's backend."""
    @property
    def module(self) -> torch.nn.Module:
        """What the steps call: the model, or its DDP/FSDP wrapper."""
    @property
    def param_groups(self) -> list[Any]:
        """The optimizer's parameter groups (``csframework.param_groups.ParamGroup``: name, members, settings),
        in the order of ``optimizer.param_groups``."""
    @property
    def train_loader(self) -> Any:
        """The stage's training loader (``csframework.data``)."""
    @property
    def val_loader(self) -> Any:
        """The first evaluation set's loader (``data.val``'s), or ``None`` without evaluation."""
    @property
    def eval_loaders(self) -> dict[str, Any]:
        """Every evaluation set's loader by name (``data.val`` as ``val``, then ``data.eval``)."""
    @property
    def stage(self) -> str: ...
    @property
    def stage_config(self) -> RunConfig: ...
    @property
    def files(self) -> SafeDir: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def distribution(self) -> dict[str, Any]:
        """Under torchrun: ``world_size``, ``strategy``, ``process_group`` (gloo/nccl); else empty."""

    # -- the loop's record, read-only: ``RunState``'s field of the same name documents each -----------------
    @property
    def global_step(self) -> int: ...
    @property
    def stage_index(self) -> int: ...
    @property
    def stage_step(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def batch_in_epoch(self) -> int: ...
    @property
    def micro_step(self) -> int: ...
    @property
    def epoch_end(self) -> bool: ...
    @property
    def last_eval_step(self) -> int: ...
    @property
    def stop_signal(self) -> int | None: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def stop_reason(self) -> str | None: ...
    @property
    def metrics(self) -> dict[str, float]: ...
    @property
    def carried(self) -> Any: ...
    @property
    def eval_seconds(self) -> float: ...
    @property
    def compile_seconds(self) -> float: ...
    @property
    def train_seconds(self) -> float: ...
    @property
    def train_steps(self) -> int: ...

    def closes_epochs(self, every: int | None) -> bool:
        """Whether the step that just ended closed epoch ``every``, ``2 * every``, ... (``False`` for ``None``)."""

    def request_stop(self, reason: str) -> None:
        """End training after the current step, as at a normal end."""

    def report(self, metrics: dict[str, float]) -> None:
        """Report metrics (``on_log_metrics``) at the current step."""

    def scale_lr(self, factor: float) -> None:
        """Multiply every learning rate by ``factor`` for the rest of the stage, as the schedule respects."""

    def set_save_due(self, due: Callable[[int], bool] | None, save: Callable[[], object] | None = None) -> None:
        """Tell the loop at which steps the caller saves the run's state (``Run.set_save_due``)."""

    def check_finite(self) -> None:
        """Raise ``NonFiniteLossError`` if the run went non-finite (the checkpoint plugin asks before saving)."""

    def summary(self) -> dict: ...

    def total_steps(self, cfg: RunConfig) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class LoopRun(RunProtocol, Protocol):
    """A run as csframework's own machinery sees it (the loop, the step, the backends, the checkpoint
    layout): ``RunProtocol`` and the loop's record itself, which the loop writes and they read."""

    state: RunState
    """The loop's record: the position, the stop request, the pending outputs and the metrics."""

    def enter_stage(self, index: int) -> None:
        """Build stage ``index`` (``Run.enter_stage``)."""


@runtime_checkable
class Backend(Protocol):
    """Executes a run's steps on one device type. Built per stage by ``BackendSpec.create(run)``. The run it
    is handed is a ``LoopRun``: what it passes on to ``csframework.step``, which reads the loop's record."""

    device_type: str
    """The device type it runs (``"CPU"``, ``"CSX"`` ...)."""
    rank: int
    """This process's rank among ``world_size`` data-parallel processes (0 and 1 when not distributed)."""
    world_size: int
    sharded: bool
    """Whether the model and optimizer state are sharded over the ranks (``strategy=fsdp``): every rank then
    takes part in checkpointing, through ``save_sharded``, ``load_sharded`` and ``read_shard_metadata``; when
    ``False`` they are saved whole in the checkpoint's ``state.pt`` (``Run.state_dict``)."""
    host_group: Any
    """The process group of host-side (CPU tensor) collectives: a gloo group beside NCCL, ``None`` for the
    default group."""
    dry_run: str | None
    """``None`` to train; else the final status of a run that only prepares each stage (CSX
    ``compile_only`` -> ``"compiled"``), for which the loop calls ``dry_stage`` instead of training."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to the device; returns the module the steps call (e.g. a DDP wrapper)."""

    def attach(self, run: LoopRun) -> None:
        """Called once the stage's model, optimizer and schedule exist (before any step)."""

    def to_device(self, batch: Any) -> Any:
        """The batch on the device."""

    def train_batch(self, run: LoopRun, batch: Any, last: bool) -> dict:
        """One micro-batch of the step (``last``: the step's final one, after which the optimizer steps, see
        ``csframework.step``); returns the outputs, or ``{}`` if it has none yet. Tensors that require grad
        may be returned as they are: the loop detaches them before any hook sees them (``RunState.keep_outputs``)."""

    def eval_batch(self, run: LoopRun, batch: Any) -> dict:
        """The outputs of one evaluation batch (detached tensors). The loop calls it under
        ``torch.inference_mode()``, or ``torch.no_grad()`` with ``loop.inference_mode=false``."""

    def dry_stage(self, run: LoopRun) -> None:
        """Prepare the current stage without training (only called when ``dry_run`` is set)."""

    def loss_scale(self) -> float | None:
        """The current dynamic loss scale, or ``None`` without dynamic loss scaling."""

    def any_rank_signal(self, signum: int | None) -> int | None:
        """The stop signal any rank had received by the previous step boundary (``signum`` when alone: the
        loop does not ask a backend whose ``world_size`` is 1)."""

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""

    def all_ranks_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (collective: every rank calls it; ``flag`` when alone)."""

    def finish(self) -> None:
        """The stage or fit ended (however): wait, bounded, for collectives still in flight."""

    def fused_optimizer(self, model: torch.nn.Module) -> bool:
        """Whether the stage's built-in optimizer is built with torch's fused implementation (asked before it
        is built; the eager backend under dynamic loss scaling, so that an overflowing step is skipped on the
        device)."""

    def checkpoint_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The model's and the optimizer's state dicts as a whole (not ``sharded``) checkpoint holds them:
        host tensors and plain values (``Run.state_dict``). A backend whose state lives on a device that
        hands it out only at certain steps returns what it fetched there."""

    def state_dict(self) -> dict:
        """The backend's part of a checkpoint (tensors and plain values)."""

    def load_state_dict(self, state: dict) -> None: ...

    def save_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Only when ``sharded``: every rank writes its shards of the model and optimizer state into
        ``directory`` (collective). The checkpoint plugin then lists and checksums the files there, which
        must be ``.metadata`` and ``__<rank>_<n>.distcp`` (the names DCP writes)."""

    def load_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                     files: set[str]) -> None:
        """Only when ``sharded``: load the shards ``save_sharded`` wrote in ``directory`` into ``model`` and
        ``optimizer`` (collective; possibly written by another number of ranks). ``files``: the names the
        checkpoint lists, checked against their checksums; no other file may be read. Runs no code from the
        files; raises ``ValueError``, ``KeyError`` or ``RuntimeError`` when they do not fit the model."""

    def read_shard_metadata(self, path: Path) -> None:
        """Only when ``sharded``: check ``path`` (a sharded checkpoint's ``sharded/.metadata``) is this
        backend's metadata, reading it without running code from it; raises (anything) when it is not, and the
        checkpoint is then treated as damaged (resume falls back to an older one)."""

    def summary(self) -> dict:
        """Extra entries of ``summary.json``."""


@dataclass(frozen=True)
class BackendSpec:
    """A plugin's backend for one device type (the ``csframework_backend`` hook returns it)."""

    device_type: str
    """Upper case, as ``device.type`` holds it (``device=toy`` composes ``device/toy.yaml``: ``type: TOY``)."""
    schema: type
    """The dataclass of the ``backend`` settings, with a ``type`` field: composition types ``backend`` with
    it, so an unknown key or a wrong type names ``backend.<key>``."""
    create: Callable[[LoopRun], Backend]
    """Builds the backend of the current stage (``run.stage_config``); ``run.backend`` is the previous
    stage's backend, if any."""
    config_path: str | None = None
    """A directory (``pkg://package`` or ``file://dir``) holding ``device/<type>.yaml`` and
    ``backend/<type>.yaml``; they are put into Hydra's ConfigStore before composition, so ``device=<type>``
    and ``backend=<type>`` compose."""
    name: str | None = None
    """Set for a backend chosen by name (``csframework_named_backends``): ``backend=<name>`` selects it, its
    ``backend/<name>.yaml`` (under ``config_path``) sets ``name: <name>``, and ``schema`` has a ``name`` field.
    ``None`` for the backend of a device type (``csframework_backend``)."""
