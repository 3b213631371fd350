"""Schema of the ``precision`` group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .readonly import ReadOnly

PRECISIONS = ("float32", "bfloat16", "float16", "cbfloat16")


@dataclass
class PrecisionConfig(ReadOnly):
    name: str = "float32"
    """``float32``, ``bfloat16``, ``float16`` or ``cbfloat16`` (CSX only). Half precisions compute under
    autocast while the master weights and optimizer state stay float32."""
    loss_scaling: Any = None
    """``dynamic``, a fixed number, or ``null`` (none). float16 and cbfloat16 need ``dynamic``."""
    init_scale: float = 65536.0
    """Dynamic loss scaling: the first scale."""
    growth_interval: int = 2000
    """Dynamic loss scaling: finite steps before the scale doubles."""
    min_scale: float = 1.0
    """Dynamic loss scaling: the run stops when overflow pushes the scale below this."""
