"""A checkpoint as csframework wrote it before issue 51 (state layout version 1, meta.json format 2): the
writer of that version (``resume.run_state`` and the checkpoint plugin's meta) kept here, frozen, so that
tests can put such checkpoints on disk and check that they still load."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from omegaconf import OmegaConf

from csframework.builtin.checkpoint.format import write_checkpoint
from csframework.data import is_iterable
from csframework.rng import rng_state

POSITION = ("global_step", "stage_index", "stage_step", "epoch", "batch_in_epoch", "micro_step", "last_eval_step")


def v1_state(run) -> dict:
    """``Run.state_dict()`` as version 1 laid it out: optional entries only when set, no model and optimizer
    when sharded, the data's end-of-pass flag beside its state."""
    loader = run.train_loader
    data = (loader.dataset.state_dict() if is_iterable(loader) and loader.num_workers == 0
            and loader.dataset.stateful() else None)
    pass_ended = data is not None and loader.dataset.pass_ended
    if run.backend.sharded:
        whole: dict = {"sharded": True}
    else:
        model, optimizer = run.backend.checkpoint_state(run.model, run.optimizer)
        for group in optimizer.get("param_groups", ()):
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
        whole = {"model": model, "optimizer": optimizer}
    stop = {} if run.stop_reason is None else {"stop_reason": run.stop_reason, "stop_settings": "(v1)"}
    return {
        "version": 1,
        **whole,
        "param_groups": [group.describe() for group in run.param_groups],
        "scheduler": run.scheduler.state_dict(),
        "backend": run.backend.state_dict(),
        "loop": dict({key: getattr(run.state, key) for key in POSITION}, stage=run.stage, **stop),
        "rng": rng_state(),
        "data": data,
        **({"data_pass_ended": True} if pass_ended else {}),
        **({"carried": run.state.carried.state_dict()} if run.state.carried is not None else {}),
    }


def write_v1_checkpoint(run) -> Path:
    """Write ``run``'s checkpoint of its current step as version 1 did, into its ``checkpoints/`` (meta.json
    then held ``global_step``; its ``format`` is not read)."""
    meta = {"global_step": run.global_step, "stage": run.stage, "plugins": {}, "metrics": dict(run.metrics),
            "run_id": run.run_id, "optimizer": type(run.optimizer).__name__}
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(dataclasses.replace(run.config)))
    root = run.output_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(root, f"step-{run.global_step:08d}", v1_state(run), meta, config_yaml)
