"""Schema of the ``optimizer`` group and its learning-rate ``schedule``."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from .readonly import ReadOnly


class OptimizerName(str, Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class ScheduleName(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class Interval(str, Enum):
    step = "step"
    epoch = "epoch"


@dataclass
class ScheduleConfig(ReadOnly):
    _target_: Optional[str] = None
    """A learning-rate scheduler class (``torch.optim.lr_scheduler.StepLR``, or your own) built with the
    optimizer and ``args``; replaces ``name``, ``warmup_steps`` and ``min_lr``."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the ``_target_`` scheduler (``optimizer.schedule.args.step_size=10``)."""
    interval: Interval = Interval.step
    """When a ``_target_`` scheduler steps: after every optimizer ``step``, or at the end of every ``epoch``."""
    name: ScheduleName = ScheduleName.constant
    """``constant``, ``linear`` (decay to ``min_lr``) or ``cosine`` (to ``min_lr``), after the warm-up."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to ``optimizer.lr``."""
    min_lr: float = 0.0
    """The learning rate at the last step for ``linear`` and ``cosine``."""


@dataclass
class OptimizerConfig(ReadOnly):
    _target_: Optional[str] = None
    """Any optimizer class (``torch.optim.RMSprop``, or your own) instead of ``name``: built with the model's
    parameters, the settings below that its constructor takes, and ``args``."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the ``_target_`` optimizer (``optimizer.args.alpha=0.9``)."""
    name: OptimizerName = OptimizerName.adamw
    """``sgd``, ``adam`` or ``adamw`` (the built-in shortcuts; ignored when ``_target_`` is set)."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """L2 penalty (sgd, adam) or decoupled weight decay (adamw)."""
    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this value; ``null`` disables clipping."""
    momentum: Optional[float] = None
    """sgd only: momentum factor."""
    nesterov: Optional[bool] = None
    """sgd only: Nesterov momentum."""
    betas: Optional[List[float]] = None
    """adam/adamw only: the two decay rates."""
    eps: Optional[float] = None
    """adam/adamw only: denominator epsilon."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""


#: Settings only some optimizers understand.
FIELDS_BY_OPTIMIZER = {"sgd": ("momentum", "nesterov"), "adam": ("betas", "eps"), "adamw": ("betas", "eps")}
