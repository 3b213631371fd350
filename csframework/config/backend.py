"""Schemas of the ``device`` and ``backend`` groups.

``device`` only picks the device type; ``backend`` holds that type's settings. One schema serves all three
types: a setting another type owns stays ``None`` here, so the validation plugin can tell "not set" from
"set for the wrong device" and refuse the latter instead of ignoring it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

from .readonly import ReadOnly

DEVICE_TYPES = ("CPU", "GPU", "CSX")


class Strategy(str, Enum):
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"


@dataclass
class DeviceConfig(ReadOnly):
    type: str = "CPU"
    """Device type: ``CPU``, ``GPU`` (CUDA) or ``CSX`` (the Cerebras emulator). Chosen with ``device=cpu|gpu|csx``."""


@dataclass
class BackendConfig(ReadOnly):
    type: str = "CPU"
    """The backend's device type; must agree with ``device.type``."""

    # -- CPU and GPU ------------------------------------------------------------------------------------
    strategy: Optional[Strategy] = None
    """CPU/GPU: ``single`` process, ``ddp`` (data parallel under torchrun; gloo on CPU, NCCL on GPU) or
    ``fsdp`` (parameters, gradients and optimizer state sharded over the ranks: FSDP2 ``fully_shard``)."""
    fsdp_wrap: Optional[List[str]] = None
    """CPU/GPU with ``strategy=fsdp``: class names of the sub-modules sharded as their own units (e.g. the
    transformer block); the rest is sharded at the root."""
    threads: Optional[int] = None
    """CPU/GPU: torch intra-op threads on the host; 0 keeps torch's default."""
    device_index: Optional[int] = None
    """GPU: the CUDA device index for single-process runs (DDP uses LOCAL_RANK)."""
    timeout_s: Optional[float] = None
    """CPU/GPU under torchrun: seconds a rank waits for the others in a collective (and at start-up) before
    it fails; a dead or stopped rank then ends the run instead of hanging it."""

    # -- CSX --------------------------------------------------------------------------------------------
    retrace_every_iteration: Optional[bool] = None
    """CSX: trace the step every iteration (side effects every iteration); a changed graph is an error."""
    compile_only: Optional[bool] = None
    """CSX: trace and compile, write the compile report, train nothing."""
    validate_only: Optional[bool] = None
    """CSX: trace and check one step, execute nothing."""
    num_csx: Optional[int] = None
    """CSX: number of systems (data parallel); global across stages; 1 <= num_csx <= batch size."""
    num_workers_per_csx: Optional[int] = None
    """CSX: input workers per system; global across stages (0: the default)."""
    compile_dir: Optional[str] = None
    """CSX: where compiled graphs are cached by fingerprint."""


#: Which backend fields each device type understands.
FIELDS_BY_TYPE = {
    "CPU": ("strategy", "threads", "timeout_s", "fsdp_wrap"),
    "GPU": ("strategy", "threads", "device_index", "timeout_s", "fsdp_wrap"),
    "CSX": ("retrace_every_iteration", "compile_only", "validate_only", "num_csx",
            "num_workers_per_csx", "compile_dir"),
}
