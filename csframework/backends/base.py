"""What a backend is to the framework: the ``Backend`` protocol the loop and ``Run`` call (defined on the low
floor, ``csframework.protocol``, and re-exported here), a base class with the optional capabilities' defaults, and ``BackendSpec``, which a plugin returns from the
``csframework_backend`` hook to supply the backend of a device type (see docs/backends.md)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..protocol import Backend, RunProtocol

__all__ = ["Backend", "BackendBase", "BackendSpec"]


_WHOLE = "{} is not sharded: the model and optimizer state are saved whole, in the checkpoint's state.pt"


class BackendBase:
    """The defaults of a single-process backend without dry runs, loss scaling or state, whose model and
    optimizer state is saved whole (``sharded = False``: the sharded methods are never called)."""

    device_type = "CPU"
    rank, world_size = 0, 1
    sharded = False
    host_group = None
    dry_run: str | None = None

    def attach(self, run: RunProtocol) -> None:
        pass

    def to_device(self, batch: Any) -> Any:
        return batch

    def dry_stage(self, run: RunProtocol) -> None:
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

    def fused_optimizer(self, model: torch.nn.Module) -> bool:
        return False

    def checkpoint_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return model.state_dict(), optimizer.state_dict()

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

    def compile_seconds(self) -> float:
        """Seconds spent compiling or tracing so far (``steps_per_sec`` leaves them out); none here."""
        return 0.0


@dataclass(frozen=True)
class BackendSpec:
    """A plugin's backend for one device type (the ``csframework_backend`` hook returns it)."""

    device_type: str
    """Upper case, as ``device.type`` holds it (``device=toy`` composes ``device/toy.yaml``: ``type: TOY``)."""
    schema: type
    """The dataclass of the ``backend`` settings, with a ``type`` field: composition types ``backend`` with
    it, so an unknown key or a wrong type names ``backend.<key>``."""
    create: Callable[[RunProtocol], Backend]
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
