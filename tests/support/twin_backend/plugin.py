"""The ``twin`` plugin: a named backend (``csframework_named_backends``) of device type CPU."""
from __future__ import annotations

from dataclasses import dataclass

import csframework as csf
from csframework import step
from csframework.backends.base import BackendBase, BackendSpec
from csframework.precision import FLOAT32


@dataclass
class TwinConfig:
    name: str = "twin"
    type: str = "A"
    """The backend's own kind (``A`` or ``B``), not the device type."""
    lr_scale: float = 1.0


class TwinBackend(BackendBase):
    device_type = "CPU"

    def __init__(self, run):
        self.kind = run.stage_config.backend.type
        self.accum, self.max_grad_norm = run.stage_config.loop.grad_accum_steps, run.stage_config.optimizer.max_grad_norm

    def prepare_model(self, model):
        return model

    def train_batch(self, run, batch, last):
        outputs = step.micro_batch(run, FLOAT32, run.module, batch, self.accum)
        if last:
            step.apply_gradients(run, FLOAT32, self.max_grad_norm)
        return step.detached(outputs)

    def eval_batch(self, run, batch):
        return step.detached(step.model_outputs(run.module(batch)))

    def summary(self):
        return {"twin": self.kind}


SPEC = BackendSpec("CPU", TwinConfig, TwinBackend, config_path="pkg://twin_backend.conf", name="twin")


@csf.hookimpl
def csframework_named_backends():
    return [SPEC]


@csf.hookimpl
def csframework_validate(config):
    if isinstance(config.backend, TwinConfig) and config.backend.type not in ("A", "B"):
        return [f"backend.type: {config.backend.type} is not A or B"]
    return []
