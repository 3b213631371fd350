"""Schema of the ``optimizer`` group and its learning-rate ``schedule``."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Dict, FrozenSet, Iterable, List, Optional, cast

from .loose_values import loose_values
from .readonly import ReadOnly


class OptimizerName(str, Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class ScheduleName(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    plateau = "plateau"


class PlateauMode(str, Enum):
    min = "min"
    max = "max"


class ThresholdMode(str, Enum):
    rel = "rel"
    abs = "abs"


class Interval(str, Enum):
    step = "step"
    epoch = "epoch"


@dataclass
class ScheduleConfig(ReadOnly):
    _target_: Optional[str] = None
    """A learning-rate scheduler class (``torch.optim.lr_scheduler.StepLR``, or your own) built with the
    optimizer and ``args``; replaces ``name``, ``warmup_steps``, ``min_lr`` and ``min_lr_ratio``."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the ``_target_`` scheduler (``optimizer.schedule.args.step_size=10``)."""
    interval: Interval = Interval.step
    """When a ``_target_`` scheduler steps: after every optimizer ``step``, or at the end of every ``epoch``."""
    name: ScheduleName = ScheduleName.constant
    """``constant``, ``linear`` (decay to ``min_lr``) or ``cosine`` (to ``min_lr``), after the warm-up;
    ``plateau``: constant, multiplied by ``factor`` whenever ``monitor`` has not improved for more than
    ``patience`` evaluations (the rule of torch's ``ReduceLROnPlateau``, stepped at each evaluation)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to ``optimizer.lr``."""
    warmup_epochs: Optional[float] = None
    """The warm-up in training epochs instead (``0.5``: half an epoch), resolved to steps from the steps an
    epoch makes (a map-style ``data.train``); replaces ``warmup_steps``. The decay of ``linear`` and
    ``cosine`` spans the stage, ``loop.max_epochs`` included."""
    min_lr_ratio: float = 0.0
    """The learning rate at the last step for ``linear`` and ``cosine``, as a fraction of ``optimizer.lr``, in
    ``[0, 1]`` (``optimizer=adamw`` sets 0.1, nanoGPT's lr/10): the floor follows the rate, so any
    ``optimizer.lr`` is accepted. ``min_lr`` replaces it."""
    min_lr: Optional[float] = None
    """The learning rate at the last step for ``linear`` and ``cosine`` as an absolute rate (``0 <= min_lr <=
    optimizer.lr``) instead of ``min_lr_ratio``; ``null``: ``min_lr_ratio`` of the rate. Setting both is
    refused, except that ``min_lr`` replaces the ratio the optimizer's group file sets (adamw's 0.1). The
    floor ``plateau`` lowers the rate to, likewise (a group with ``lr_scale`` keeps its ratio)."""
    factor: float = 0.1
    """``plateau``: what the rate is multiplied by at each reduction (below 1)."""
    patience: int = 10
    """``plateau``: evaluations without improvement that are tolerated; the next one reduces the rate."""
    threshold: float = 1e-4
    """``plateau``: how much better than the best a value must be to count as an improvement."""
    threshold_mode: ThresholdMode = ThresholdMode.rel
    """``plateau``: ``rel`` (better than ``best * (1 - threshold)`` for ``min``, ``best * (1 + threshold)``
    for ``max``) or ``abs`` (better than ``best - threshold`` / ``best + threshold``)."""
    cooldown: int = 0
    """``plateau``: evaluations after a reduction during which none is counted as bad."""
    monitor: str = "val/loss"
    """``plateau``: the metric an evaluation reports (``val/loss``, ``val/accuracy``, a plugin's) that it
    watches."""
    mode: PlateauMode = PlateauMode.min
    """``plateau``: ``min`` (lower ``monitor`` is better) or ``max``."""

def min_lr_factor(cfg: "OptimizerConfig") -> float:
    """The fraction of ``cfg.lr`` the ``linear`` and ``cosine`` schedules decay to: ``schedule.min_lr / lr``
    where an absolute ``min_lr`` is set, else ``schedule.min_lr_ratio``."""
    sched = cfg.schedule
    if sched.min_lr is not None:
        return sched.min_lr / cfg.lr if cfg.lr else 0.0
    return sched.min_lr_ratio


def final_lr(cfg: "OptimizerConfig") -> float:
    """The learning rate ``linear`` and ``cosine`` reach at the last step (``min_lr``, or ``lr * min_lr_ratio``)."""
    sched = cfg.schedule
    return sched.min_lr if sched.min_lr is not None else cfg.lr * sched.min_lr_ratio


#: The entry of ``optimizer.weight_decay_exclude`` that stands for every parameter with fewer than two
#: dimensions (biases, norm scales), rather than a name pattern.
BELOW_2D = "ndim<2"


@dataclass
class ParamGroupConfig(ReadOnly):
    """One named parameter group of ``optimizer.groups``."""

    params: List[str] = field(default_factory=list)
    """Name patterns (``fnmatch``: ``encoder.*``, ``*.bias``) of the parameters in this group; a parameter
    joins the first group, in the mapping's order, with a pattern matching its name."""
    lr_scale: float = 1.0
    """This group's learning rate as a multiple of ``optimizer.lr`` (the schedule scales it alike)."""
    weight_decay: Optional[float] = None
    """This group's weight decay; ``null``: ``optimizer.weight_decay``, with ``weight_decay_exclude``."""


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
    weight_decay_exclude: List[str] = field(default_factory=lambda: [BELOW_2D])
    """Parameters that get no weight decay: name patterns (``fnmatch``: ``*.bias``, ``wte.*``) and
    ``ndim<2``, every parameter with fewer than two dimensions (biases and norm scales, as nanoGPT, minGPT
    and Hugging Face's Trainer do; the default). ``[]`` decays every parameter (what every run did before
    this setting existed)."""
    groups: Dict[str, Any] = field(default_factory=dict)
    """Named parameter groups with their own learning-rate scale or weight decay, each a
    ``ParamGroupConfig`` (``+optimizer.groups.head.params=[lm_head.*] +optimizer.groups.head.lr_scale=0.1``;
    typed when the run is built: OmegaConf cannot add to a mapping of dataclasses from the command line)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    overridden: ClassVar[FrozenSet[str]] = frozenset()
    """Set on the instance by composition, not a config key: the keys (``lr``, ``schedule.min_lr``) that an
    override named (the command line's, ``csf.compose``'s, a sweep job's) or a stage's config sets."""
    from_group: ClassVar[bool] = False
    """Set on the instance by composition: csframework's own ``optimizer`` group option (``adamw`` ...) gave
    the values no override named, so they are its defaults. False for a config built in Python or from the
    user's own option file, whose values are the user's wherever they differ from the schema's."""

    def is_set(self, key: str) -> bool:
        """Whether the user set ``key`` (``weight_decay``, ``schedule.min_lr``), so that a ``_target_`` class
        that does not take it is an error rather than the setting left out: named by an override (an explicit
        value equal to the default counts), or, unless ``from_group``, different from the schema's default."""
        parts = key.split(".")
        if any(".".join(parts[:i]) in self.overridden for i in range(1, len(parts) + 1)):
            return True
        if self.from_group:
            return False
        node: Any = self
        default: Any = OptimizerConfig()
        for part in parts:
            node, default = getattr(node, part), getattr(default, part)
        return bool(node != default)


#: csframework's own options of the ``optimizer`` group (``conf/optimizer/<name>.yaml``).
BUILTIN_OPTIONS = frozenset(name.value for name in OptimizerName)


def mark_user_set(optimizer: OptimizerConfig, from_group: bool, overridden: Iterable[str]) -> None:
    """Record on ``optimizer`` what composition knows of who set its values (``OptimizerConfig.is_set``):
    ``from_group``, whether one of ``BUILTIN_OPTIONS`` gave the defaults, and ``overridden``, the dotted keys
    from the root (``optimizer.lr``) that the overrides, or a stage's config, set."""
    # not config keys: set on the instance over the ClassVars' defaults
    optimizer.overridden = frozenset(key.removeprefix("optimizer.") for key in overridden  # type: ignore[misc]
                                     if key.startswith("optimizer."))
    optimizer.from_group = from_group  # type: ignore[misc]


#: Settings only some optimizers understand.
FIELDS_BY_OPTIMIZER = {"sgd": ("momentum", "nesterov"), "adam": ("betas", "eps"), "adamw": ("betas", "eps")}


def param_group_configs(groups: Dict[str, Any]) -> Dict[str, ParamGroupConfig]:
    """``optimizer.groups`` typed: each entry as a ``ParamGroupConfig``; a ``ValueError`` naming the key of
    an entry that is not one (an unknown key, a value of the wrong type)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    typed: Dict[str, ParamGroupConfig] = {}
    for name, value in groups.items():
        key = f"optimizer.groups.{name}"
        if not isinstance(value, dict) and not OmegaConf.is_dict(value):
            raise ValueError(f"{key}: needs params (name patterns) and lr_scale or weight_decay, "
                             f"e.g. +{key}.params=[encoder.*] +{key}.lr_scale=0.1")
        loose = loose_values(OmegaConf.to_container(value) if OmegaConf.is_dict(value) else value,
                             ParamGroupConfig, key + ".")
        if loose:
            raise ValueError("; ".join(loose))
        try:
            merged = OmegaConf.merge(OmegaConf.structured(ParamGroupConfig), value)
            typed[name] = cast(ParamGroupConfig, OmegaConf.to_object(merged))
        except OmegaConfBaseException as e:
            where = getattr(e, "full_key", None) or ""
            raise ValueError(f"{key}{'.' + where if where else ''}: {e.msg if hasattr(e, 'msg') else e}; "
                             "its keys are params, lr_scale and weight_decay") from e
    return typed
