"""What a backend is to the framework: the ``Backend`` protocol the loop and ``Run`` call, a base class with
the optional capabilities' defaults, and ``BackendSpec``, which a plugin returns from the
``csframework_backend`` hook to supply the backend of a device type (see docs/backends.md)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..run import Run


@runtime_checkable
class Backend(Protocol):
    """Executes a run's steps on one device type. Built per stage by ``BackendSpec.create(run)``."""

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

    def attach(self, run: Run) -> None:
        """Called once the stage's model, optimizer and schedule exist (before any step)."""

    def to_device(self, batch: Any) -> Any:
        """The batch on the device."""

    def train_batch(self, run: Run, batch: Any, last: bool) -> dict:
        """One micro-batch of the step (``last``: the step's final one, after which the optimizer steps, see
        ``csframework.step``); returns the outputs (detached tensors), or ``{}`` if it has none yet."""

    def eval_batch(self, run: Run, batch: Any) -> dict:
        """The outputs of one evaluation batch (detached tensors). The loop calls it under
        ``torch.inference_mode()``, or ``torch.no_grad()`` with ``loop.inference_mode=false``."""

    def dry_stage(self, run: Run) -> None:
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


_WHOLE = "{} is not sharded: the model and optimizer state are saved whole, in the checkpoint's state.pt"


class BackendBase:
    """The defaults of a single-process backend without dry runs, loss scaling or state, whose model and
    optimizer state is saved whole (``sharded = False``: the sharded methods are never called)."""

    device_type = "CPU"
    rank, world_size = 0, 1
    sharded = False
    host_group = None
    dry_run: str | None = None

    def attach(self, run: Run) -> None:
        pass

    def to_device(self, batch: Any) -> Any:
        return batch

    def dry_stage(self, run: Run) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no dry run")

    def loss_scale(self) -> float | None:
        return None

    def any_rank_signal(self, signum: int | None) -> int | None:
        return signum

    def broadcast(self, value: Any) -> Any:
        return value

    def all_ranks_agree(self, flag: bool) -> bool:
        return flag

    def finish(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def save_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        raise NotImplementedError(_WHOLE.format(type(self).__name__))

    def load_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                     files: set[str]) -> None:
        raise NotImplementedError(_WHOLE.format(type(self).__name__))

    def read_shard_metadata(self, path: Path) -> None:
        raise NotImplementedError(_WHOLE.format(type(self).__name__))

    def summary(self) -> dict:
        return {}


@dataclass(frozen=True)
class BackendSpec:
    """A plugin's backend for one device type (the ``csframework_backend`` hook returns it)."""

    device_type: str
    """Upper case, as ``device.type`` holds it (``device=toy`` composes ``device/toy.yaml``: ``type: TOY``)."""
    schema: type
    """The dataclass of the ``backend`` settings, with a ``type`` field: composition types ``backend`` with
    it, so an unknown key or a wrong type names ``backend.<key>``."""
    create: Callable[[Run], Backend]
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
