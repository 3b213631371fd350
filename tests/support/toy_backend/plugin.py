"""The ``toy`` plugin: the TOY device type runs on the CPU, eagerly, with the framework's step sequence."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import csframework as csf
from csframework import step
from csframework.backends.base import BackendBase, BackendSpec


@dataclass
class ToyConfig:
    type: str = "TOY"
    lr_scale: float = 1.0
    """Multiplies every gradient before the optimizer step."""


class ToyOps:
    """The step primitives: float32, no loss scaling; ``lr_scale`` applied when unscaling."""

    def __init__(self, lr_scale: float):
        self.lr_scale = lr_scale

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def unscale(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch._foreach_mul_(grads, self.lr_scale)

    def optimizer_step(self, optimizer, skip):
        optimizer.step()

    def update(self):
        pass


class ToyBackend(BackendBase):
    device_type = "TOY"

    def __init__(self, run):
        cfg = run.stage_config
        self.ops = ToyOps(cfg.backend.lr_scale)
        self.accum, self.max_grad_norm = cfg.loop.grad_accum_steps, cfg.optimizer.max_grad_norm

    def prepare_model(self, model):
        return model

    def train_batch(self, run, batch, last):
        outputs = step.micro_batch(run, self.ops, run.module, batch, self.accum)
        if last:
            step.apply_gradients(run, self.ops, self.max_grad_norm)
        return outputs  # the loop detaches them

    def eval_batch(self, run, batch):  # the loop calls it under torch.inference_mode()
        return step.detached(step.model_outputs(run.module(batch)))

    def summary(self):
        return {"toy": True}


SPEC = BackendSpec("TOY", ToyConfig, ToyBackend, config_path="pkg://toy_backend.conf")


@csf.hookimpl
def csframework_device_types():
    return ["TOY"]


@csf.hookimpl
def csframework_backend(device_type):
    return SPEC if device_type == "TOY" else None


@csf.hookimpl
def csframework_validate(config):
    if isinstance(config.backend, ToyConfig) and config.backend.lr_scale <= 0:
        return [f"backend.lr_scale: {config.backend.lr_scale} must be > 0"]
    return []
