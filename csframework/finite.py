"""Whether a run's numbers are still finite: its losses since the last log (under dynamic loss scaling: its
loss scale's floor) and its parameters; the loop checks at each log and evaluation, the checkpoint plugin
before saving (``Run.check_finite``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import NonFiniteLossError
from .state import window

if TYPE_CHECKING:
    from .protocol import LoopRun, RunProtocol


def check_parameters_finite(run: RunProtocol) -> None:
    """Raise ``NonFiniteLossError`` naming the first parameter that is not finite. One synchronisation;
    under a sharded backend each rank checks its own shards, and all ranks agree (all of them save or none)."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in run.model.parameters()]
    finite = not flags or bool(torch.stack(flags).all())
    if run.backend.sharded:  # under ddp only rank 0 saves, so only a sharded backend's ranks all ask
        finite = run.backend.all_ranks_agree(finite)
    if not finite:
        names = [n for (n, _), ok in zip(run.model.named_parameters(), flags) if not ok] or ["(on another rank)"]
        raise NonFiniteLossError(f"parameter {names[0]} is not finite after step {run.global_step}; "
                                 "lower optimizer.lr, set optimizer.max_grad_norm, or use loss scaling")


def check_finite(run: LoopRun, losses: torch.Tensor | None = None) -> torch.Tensor | None:
    """Raise ``NonFiniteLossError`` naming the step if a loss since the last log is NaN or infinite.

    Under dynamic loss scaling such a step was skipped by the scaler, which is not an error until the scale
    falls below ``precision.min_scale``; then the mask of finite losses is returned (``None``: all finite).
    """
    pending = run.state.pending.get("loss")
    if losses is None and pending:
        losses = window(pending)
    finite = torch.isfinite(losses) if losses is not None else None
    first_bad = None
    if losses is not None and finite is not None and not bool(finite.all()):
        bad = int((~finite).nonzero()[0])
        first_bad = (run.global_step - len(losses) + 1 + bad, losses[bad].item())
    if run.stage_config.precision.loss_scaling != "dynamic":
        if first_bad is not None:
            raise NonFiniteLossError(f"the loss is {first_bad[1]} at step {first_bad[0]}; lower optimizer.lr, set "
                                     "optimizer.max_grad_norm, or use loss scaling")
        return None
    scale = run.backend.loss_scale()
    floor = run.stage_config.precision.min_scale
    if scale is not None and scale < floor:
        since = f" (a non-finite loss at step {first_bad[0]})" if first_bad is not None else ""
        raise NonFiniteLossError(f"the dynamic loss scale fell to {scale:g}, below precision.min_scale={floor:g}, "
                                 f"by step {run.global_step}{since}: the loss or its gradients keep overflowing; "
                                 "lower optimizer.lr or check the data")
    return finite if first_bad is not None else None
