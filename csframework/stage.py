"""``Stage``: what a run builds for each of its stages (``Run.enter_stage``) — the backend, the module the
steps call, the data loaders, the optimizer with its parameter groups and the learning-rate schedule — all
present from the moment the stage is entered, so nothing that reads them checks for ``None``.

``Run`` holds the current one and exposes its parts as ``run.backend``, ``run.module``, ``run.train_loader``,
``run.eval_loaders``, ``run.val_loader``, ``run.optimizer``, ``run.param_groups`` and ``run.scheduler``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config import RunConfig
from .data import FrameworkLoader, is_iterable, stage_loaders, total_steps
from .errors import ConfigError, one_line
from .param_groups import ParamGroup
from .protocol import Backend, BackendSpec
from .schedule import build_optimizer, build_scheduler


@dataclass
class Stage:
    """One stage's parts, built together by ``build_stage``."""

    backend: Backend
    """Runs the stage's steps (``BackendSpec.create``)."""
    module: torch.nn.Module
    """What the steps call: the model, or its DDP/FSDP wrapper (``Backend.prepare_model``)."""
    train_loader: FrameworkLoader
    """The training set's loader (``data.train``)."""
    eval_loaders: dict[str, FrameworkLoader]
    """Every evaluation set's loader by name (``data.val`` as ``val`` first, then ``data.eval``'s)."""
    optimizer: torch.optim.Optimizer
    """The optimizer (a backend may replace it in ``attach``: the Cerebras one by cstorch's)."""
    param_groups: list[ParamGroup]
    """The optimizer's parameter groups, in the order of ``optimizer.param_groups``."""
    scheduler: Any
    """The learning-rate schedule (``csframework.schedule``, or a backend's own)."""

    @property
    def val_loader(self) -> FrameworkLoader | None:
        """The first evaluation set's loader (``data.val``'s), or ``None`` without evaluation."""
        return next(iter(self.eval_loaders.values()), None)

    def release(self) -> None:
        """Stop every loader's worker processes and wait for the backend's pending collectives."""
        for loader in (self.train_loader, *self.eval_loaders.values()):
            loader.close()
        self.backend.finish()


def backend_spec(cfg: RunConfig, backends: dict[str, BackendSpec], named: dict[str, BackendSpec]) -> BackendSpec:
    """The backend of ``cfg``: the one chosen by name (``backend=cerebras``), else its device type's."""
    name = getattr(cfg.backend, "name", None)
    spec = named.get(name) if name is not None else backends.get(cfg.device.type)
    if spec is None:
        raise ConfigError(f"device: no plugin supplies a backend for {cfg.device.type} "
                          f"(device types: {', '.join(backends) or 'none'}); check plugins.disable")
    return spec


def build_stage(backend: Backend, model: torch.nn.Module, cfg: RunConfig) -> Stage:
    """The stage ``cfg`` describes around ``backend`` (created for it) and ``model`` (kept across stages).
    The backend is finished again when a part cannot be built."""
    try:
        module = backend.prepare_model(model)
        train_loader, eval_loaders = stage_loaders(cfg, backend.rank, backend.world_size)
        try:
            optimizer, param_groups = build_optimizer(model.named_parameters(), cfg.optimizer,
                                                      fused=backend.fused_optimizer(model))
        except ValueError as e:  # torch's own range checks, if the validation plugin is disabled
            raise ConfigError(f"optimizer: {one_line(e)}") from e
        per_epoch = None if is_iterable(train_loader) else len(train_loader) / cfg.loop.grad_accum_steps
        scheduler = build_scheduler(optimizer, cfg.optimizer, total_steps(cfg, train_loader), per_epoch)
    except BaseException:
        backend.finish()
        raise
    return Stage(backend, module, train_loader, eval_loaders, optimizer, param_groups, scheduler)
