"""Range checks of config values, shared by the core's validation rules and the backend plugins' rules."""
from __future__ import annotations

import math
from typing import Any

#: Steps, epochs, batch sizes and other counts: exact as float64 (metrics, JSON) and far from int64 overflow.
MAX_COUNT = 2**53
#: Threads and loader worker processes: a sane ceiling (more would exhaust processes or memory).
MAX_PARALLEL = 1024
#: Longest wait a timeout may ask for: one year (a larger one overflows the waits underneath).
MAX_TIMEOUT_S = 365 * 86400
#: ``loop.collect_max_memory_mb``: up to a tebibyte.
MAX_MEMORY_MB = 2**20
#: Seeds: the range of NumPy's seed; ``seed * 1_000_003 + epoch`` (data order) then stays below 2**64,
#: the limit of ``torch.Generator.manual_seed``.
MAX_SEED = 2**32 - 1
#: The largest float32: learning rates, their scales and the optimizer's other settings become float32
#: scalars in its update (torch refuses a larger one there, "cannot be converted ... without overflow").
MAX_FLOAT32 = 3.4028234663852886e38  # torch.finfo(torch.float32).max
#: Loss scales live in float32 tensors.
MAX_SCALE = MAX_FLOAT32
#: The dynamic loss scaler counts towards ``growth_interval`` in an int32 tensor.
MAX_GROWTH_INTERVAL = 2**31 - 1


def check_range(key: str, value: Any, low: float | None = None, high: float | None = None, *,
                open_low: bool = False, open_high: bool = False, hint: str = "") -> list[str]:
    """``[]`` when ``value`` is ``None`` (not set) or a finite number within the bounds (``open_*``: the
    bound itself excluded), else the problem line naming ``key``. Finiteness is tested first: every
    comparison with NaN is false, so a bare ``value < low`` would let NaN through."""
    if value is None:
        return []
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if finite and not (low is not None and (value <= low if open_low else value < low)
                       or high is not None and (value >= high if open_high else value > high)):
        return []
    shown = [f"{b:g}" if isinstance(b, float) else str(b) for b in (low, high)]
    if low is not None and high is not None:
        bounds = (f"between {shown[0]} and {shown[1]}" if not (open_low or open_high) else
                  f"in {'(' if open_low else '['}{shown[0]}, {shown[1]}{')' if open_high else ']'}")
    elif low is not None:
        bounds = f"{'>' if open_low else '>='} {shown[0]}"
    else:
        bounds = f"{'<' if open_high else '<='} {shown[1]}"
    return [f"{key}: {value} must be {'' if finite else 'a finite number '}{bounds}{hint}"]
