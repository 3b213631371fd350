"""What a backend is to the framework: the ``Backend`` protocol the loop and ``Run`` call and ``BackendSpec``,
which a plugin returns from the ``csframework_backend`` hook to supply the backend of a device type (both
defined on the low floor, ``csframework.protocol``, and re-exported here), and a base class with the optional
capabilities' defaults (see docs/guides/backends.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..protocol import Backend, BackendSpec, LoopRun

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

    def attach(self, run: LoopRun) -> None:
        pass

    def to_device(self, batch: Any) -> Any:
        return batch

    def dry_stage(self, run: LoopRun) -> None:
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
