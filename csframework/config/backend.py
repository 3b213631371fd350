"""Schemas of the ``device`` and ``backend`` groups.

``device`` only picks the device type; ``backend`` holds that type's settings. One schema serves all three
types: a setting another type owns stays ``None`` here, so the validation plugin can tell "not set" from
"set for the wrong device" and refuse the latter instead of ignoring it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from .readonly import ReadOnly

DEVICE_TYPES = ("CPU", "GPU", "CSX")


class Strategy(str, Enum):
    single = "single"
    ddp = "ddp"


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
    """CPU/GPU: ``single`` process, or ``ddp`` (data parallel under torchrun; gloo on CPU, NCCL on GPU)."""
    threads: Optional[int] = None
    """CPU/GPU: torch intra-op threads on the host; 0 keeps torch's default."""
    device_index: Optional[int] = None
    """GPU: the CUDA device index for single-process runs (DDP uses LOCAL_RANK)."""

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
    "CPU": ("strategy", "threads"),
    "GPU": ("strategy", "threads", "device_index"),
    "CSX": ("retrace_every_iteration", "compile_only", "validate_only", "num_csx",
            "num_workers_per_csx", "compile_dir"),
}
