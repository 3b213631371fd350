"""Optimizers and learning-rate schedules: the built-in ones (a schedule is a pure function of the step, so
eager and traced (CSX) runs share it), or any class named by ``_target_``."""
from __future__ import annotations

import dataclasses
import inspect
import math
import warnings

import torch

from .config import OptimizerConfig, plain
from .config.optimizer import PlateauMode, ScheduleName, ThresholdMode, final_lr, min_lr_factor
from .errors import ConfigError
from .param_groups import ParamGroup, optimizer_params, parameter_groups
from .plateau import Plateau, monitored_value
from .targets import call, find_target

#: Settings of the ``optimizer`` group a ``_target_`` optimizer receives when its constructor takes them.
SHARED_SETTINGS = ("lr", "weight_decay", "momentum", "nesterov", "betas", "eps")
#: ``plateau``'s settings, as the schedule's plan saves them, with the type each is read back as.
PLATEAU_SETTINGS = {"factor": float, "patience": int, "threshold": float, "threshold_mode": ThresholdMode,
                    "cooldown": int, "monitor": str, "mode": PlateauMode}
#: The settings only the built-in schedules use (an error beside a ``_target_`` scheduler).
BUILTIN_SCHEDULE_SETTINGS = ("name", "warmup_steps", "warmup_epochs", "min_lr", "min_lr_ratio", *PLATEAU_SETTINGS)


def lr_factor(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """The multiplier of ``cfg.lr`` used by optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` (the first step already uses ``1/warmup_steps``), then constant,
    or a linear or cosine decay reaching ``min_lr_ratio`` of the rate (or ``min_lr``) at the last step.
    """
    sched = cfg.schedule
    warmup = sched.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    name = getattr(sched.name, "value", sched.name)
    if name in ("constant", "plateau") or cfg.lr == 0:  # plateau: its reductions multiply this
        return 1.0
    floor = min_lr_factor(cfg)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup - 1))
    if name == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule:
    """Sets each param group's rate to ``base_lr * lr_factor(step)`` before every optimizer step (written
    when the factor changes: a constant rate is written once).

    Its state holds its plan (kind, warm-up, ``lr``, ``min_lr`` or ``min_lr_ratio`` and the steps it spans), so
    a resumed run goes on with the schedule it was saved with, as torch's schedulers keep their settings (``T_max``):
    settings changed since (``loop.max_steps`` raised, say) do not bend the rate of the steps already
    planned; past the planned steps the rate is what the plan gives there: its final value (after the rest of
    a warm-up longer than the plan).

    The interface of a torch ``LRScheduler`` that code uses (``step``, ``get_last_lr``, ``last_epoch``,
    ``base_lrs``, ``state_dict``, ``load_state_dict``) without its per-step bookkeeping, which costs
    more than the rest of the loop on a small model. ``last_epoch`` counts optimizer steps, as in torch.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
        self.optimizer = optimizer
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.last_epoch = 0
        self.scale = 1.0  # run.scale_lr's multiplier of every rate (a plugin's)
        self._plan(cfg, total_steps)
        self._apply()

    def _plan(self, cfg: OptimizerConfig, total_steps: int) -> None:
        self.cfg, self.total_steps = cfg, total_steps
        self._factor: float | None = None  # the factor the param groups' rates were last set with
        # from this step on the factor no longer changes: the rates set then stay (no per-step work)
        name = getattr(cfg.schedule.name, "value", cfg.schedule.name)
        warmup = cfg.schedule.warmup_steps
        self._settled = warmup if name in ("constant", "plateau") or cfg.lr == 0 else max(warmup + 1, total_steps - 1)
        self.plateau = Plateau(cfg.schedule, cfg.lr) if name == "plateau" else None

    def step(self) -> None:
        """Called once after each optimizer step: set the rate of the next one."""
        self.last_epoch += 1
        if self.last_epoch <= self._settled:
            self._apply()

    def evaluated(self, metrics: dict) -> None:
        """Called after each evaluation of a fit with its metrics: ``plateau`` takes the monitored value and
        may reduce the rate of the next steps; the other schedules count steps only."""
        if self.plateau is not None and self.plateau.observe(monitored_value(self.cfg.schedule, metrics)):
            self._factor = None
            self._apply()

    def scale_lr(self, factor: float) -> None:
        """Multiply every rate by ``factor`` from the next step on, for the rest of the run (``run.scale_lr``)."""
        self.scale *= factor
        self._factor = None
        self._apply()

    def _apply(self) -> None:
        factor = lr_factor(self.last_epoch, self.cfg, self.total_steps) * self.scale
        if self.plateau is not None:
            factor *= self.plateau.scale
        if factor == self._factor:  # a constant rate: the groups already have it
            return
        self._factor = factor
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            if isinstance(group["lr"], torch.Tensor):  # backend.compile: the compiled update reads this tensor
                group["lr"].fill_(base * factor)
            else:
                group["lr"] = base * factor

    def epoch_end(self) -> None:
        """Called at the end of each training epoch; the built-in schedules count optimizer steps only."""

    def get_last_lr(self) -> list[float]:
        """The rate of each param group for the next optimizer step."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        sched = self.cfg.schedule
        # min_lr: the final rate (what older checkpoints hold); min_lr_ratio: the fraction, where the floor is
        # one (lr * ratio / lr need not give the ratio back bit for bit)
        ratio = sched.min_lr_ratio if sched.min_lr is None else None
        plan = {"name": getattr(sched.name, "value", sched.name), "warmup_steps": sched.warmup_steps,
                "lr": self.cfg.lr, "min_lr": final_lr(self.cfg), "min_lr_ratio": ratio,
                "total_steps": self.total_steps}
        state = {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs), "plan": plan, "scale": self.scale}
        if self.plateau is not None:
            plan.update({key: getattr(getattr(sched, key), "value", getattr(sched, key)) for key in PLATEAU_SETTINGS})
            state["plateau"] = self.plateau.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved schedule: its plan replaces this one's (a state without one, from a torch
        ``LambdaLR`` or an older checkpoint, keeps this one's plan)."""
        self.last_epoch, self.base_lrs = int(state["last_epoch"]), list(state["base_lrs"])
        plan = state.get("plan")
        if plan is not None:
            try:  # read from a checkpoint: anything else than what state_dict writes is refused
                ratio = plan.get("min_lr_ratio")  # absent from older checkpoints: their min_lr is absolute
                floor = dict(min_lr=None, min_lr_ratio=float(ratio)) if ratio is not None else dict(
                    min_lr=float(plan["min_lr"]), min_lr_ratio=0.0)
                plateau = {key: kind(plan[key]) for key, kind in PLATEAU_SETTINGS.items() if key in plan}
                schedule = dataclasses.replace(self.cfg.schedule, name=ScheduleName(plan["name"]),
                                               warmup_steps=int(plan["warmup_steps"]), **floor, **plateau)
                cfg = dataclasses.replace(self.cfg, lr=float(plan["lr"]), schedule=schedule)
                total_steps = int(plan["total_steps"])
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"its learning-rate schedule's plan is unreadable ({type(e).__name__}: {e})") from e
            self._plan(cfg, total_steps)
        self.scale = float(state.get("scale", 1.0))
        if self.plateau is not None and "plateau" in state:
            self.plateau.load_state_dict(state["plateau"])
        self._factor = None  # new base rates: write them whatever the factor
        self._apply()


class TargetSchedule:
    """A torch ``LRScheduler`` (``optimizer.schedule._target_``) behind the ``Schedule`` interface, stepped
    after each optimizer step or, with ``optimizer.schedule.interval=epoch``, at the end of each epoch.
    Other attributes are the scheduler's own; its ``state_dict`` goes into checkpoints, so resume is exact."""

    def __init__(self, scheduler, per_epoch: bool):
        self.scheduler, self.per_epoch = scheduler, per_epoch

    def step(self) -> None:
        if not self.per_epoch:
            self._step()

    def evaluated(self, metrics: dict) -> None:
        """A ``_target_`` scheduler steps on steps or epochs only (``ReduceLROnPlateau`` is refused)."""

    def scale_lr(self, factor: float) -> None:
        """Multiply every rate by ``factor`` (``run.scale_lr``): the param groups' rates and the scheduler's
        ``base_lrs``, from which torch's schedulers compute theirs (both are in its checkpoints)."""
        for group in self.scheduler.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].mul_(factor)
            else:
                group["lr"] = group["lr"] * factor
        if hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]

    def epoch_end(self) -> None:
        if self.per_epoch:
            self._step()

    def _step(self) -> None:
        with warnings.catch_warnings():
            # the optimizer step ran, but not through `optimizer.step()` (a skipped loss-scaled step, or the
            # CSX graph), which torch counts to warn about a scheduler stepped first
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


def scale_run_lr(run, factor: float) -> None:
    """``run.scale_lr``: multiply the stage's every rate by ``factor`` (a finite number above 0) through its
    schedule (``Schedule.scale_lr``, ``TargetSchedule.scale_lr``)."""
    factor = float(factor)
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"run.scale_lr({factor!r}): the factor must be a finite number above 0")
    if not hasattr(run.scheduler, "scale_lr"):  # a backend's own schedule (attach may replace it)
        raise ConfigError(f"run.scale_lr: this stage's schedule ({type(run.scheduler).__name__}, the backend's) "
                          "cannot scale its rates; set them through the backend's schedule")
    run.scheduler.scale_lr(factor)
    run.log.info("lr_scaled", factor=factor, lr=float(run.optimizer.param_groups[0]["lr"]))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int,
                    steps_per_epoch: float | None = None):
    """The schedule of ``cfg.schedule`` for ``total_steps`` optimizer steps (stepped once per step);
    ``steps_per_epoch`` resolves ``warmup_epochs`` (``None``: an iterable training set, refused with it)."""
    cfg = in_steps(cfg, steps_per_epoch)
    if cfg.schedule._target_:
        cls, kwargs = schedule_spec(cfg)
        scheduler = call("optimizer.schedule", cfg.schedule._target_, cls, optimizer, **kwargs)
        return TargetSchedule(scheduler, getattr(cfg.schedule.interval, "value", cfg.schedule.interval) == "epoch")
    return Schedule(optimizer, cfg, total_steps)


def in_steps(cfg: OptimizerConfig, steps_per_epoch: float | None) -> OptimizerConfig:
    """``cfg`` with ``schedule.warmup_epochs`` resolved to ``warmup_steps`` (rounded to a whole step)."""
    epochs = cfg.schedule.warmup_epochs
    if epochs is None:
        return cfg
    if steps_per_epoch is None:
        raise ConfigError("optimizer.schedule.warmup_epochs: data.train is an IterableDataset, whose epochs have "
                          "no length known in advance; use optimizer.schedule.warmup_steps")
    schedule = dataclasses.replace(cfg.schedule, warmup_steps=round(epochs * steps_per_epoch), warmup_epochs=None)
    return dataclasses.replace(cfg, schedule=schedule)


def build_optimizer(named_params, cfg: OptimizerConfig,
                    fused: bool = False) -> tuple[torch.optim.Optimizer, list[ParamGroup]]:
    """The optimizer of ``cfg`` over ``named_params`` (``model.named_parameters()``) and its parameter
    groups (``optimizer.groups``, ``weight_decay_exclude``): the class of ``_target_``, or the built-in one
    ``cfg.name`` names (torch's fused implementation with ``fused``: ``precision.FUSED_SKIPPING``)."""
    if cfg._target_:
        cls, kwargs = optimizer_spec(cfg)
        groups = parameter_groups(list(named_params), cfg, float(kwargs.get("weight_decay") or 0.0))
        if "lr" not in kwargs and any(g.lr_scale != 1.0 for g in groups):
            raise ConfigError(f"optimizer.groups: {cfg._target_} takes no 'lr', so a group's lr_scale has "
                              "nothing to scale; remove lr_scale")
        params: list = optimizer_params(groups, kwargs.get("lr"), float(kwargs.get("weight_decay") or 0.0))
        if len(params) == 1 and set(params[0]) == {"params", "name"}:
            # one group with the optimizer's own settings: plain parameters, as model.parameters() gives, so a
            # user's optimizer that groups them itself keeps working (optimizer.weight_decay_exclude=[])
            params = params[0]["params"]
        return call("optimizer", cfg._target_, cls, params, **kwargs), groups
    groups = parameter_groups(list(named_params), cfg, cfg.weight_decay)
    params = optimizer_params(groups, cfg.lr, cfg.weight_decay)
    name = getattr(cfg.name, "value", cfg.name)
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, **({"fused": True} if fused else {}))
    if name == "sgd":
        return torch.optim.SGD(params, momentum=cfg.momentum or 0.0, nesterov=bool(cfg.nesterov), **kwargs), groups
    if cfg.betas is not None:
        kwargs["betas"] = tuple(cfg.betas)
    if cfg.eps is not None:
        kwargs["eps"] = cfg.eps
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, **kwargs), groups


# -- classes by `_target_` ----------------------------------------------------------------------------------
def locate_class(path: str, key: str) -> type:
    """The class at the dotted ``path``, or a ``ConfigError`` naming ``key``."""
    found = find_target(path, key)
    if not isinstance(found, type):
        raise ConfigError(f"{key}: '{path}' is a {type(found).__name__}, not a class")
    return found


def _takes(cls) -> tuple[set[str] | None, set[str]]:
    """The keyword arguments ``cls`` takes after its first (``None``: any, it has ``**kwargs``) and those
    it requires."""
    try:
        params = list(inspect.signature(cls).parameters.values())[1:]
    except (TypeError, ValueError):
        return None, set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        takes = None
    else:
        takes = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return takes, required


def _check_args(path: str, key: str, args: dict, takes, required, given) -> None:
    for name in args:
        if takes is not None and name not in takes:
            raise ConfigError(f"{key}.args.{name}: {path} does not take '{name}' "
                              f"(it takes {', '.join(sorted(takes)) or 'nothing'}); remove it")
    missing = sorted(required - set(given))
    if missing:
        raise ConfigError(f"{key}.args.{missing[0]}: {path} needs it; set {key}.args.{missing[0]}=<value>")


def _target_of(target: str | None, key: str) -> str:
    """The ``_target_`` a spec is asked for only when it is set (``build_optimizer`` checks first)."""
    if not target:
        raise ConfigError(f"{key}: not set; set it to the dotted path of a class")
    return target


def optimizer_spec(cfg: OptimizerConfig) -> tuple[type, dict]:
    """The class of ``optimizer._target_`` and its keyword arguments: ``optimizer.args``, plus the shared
    settings (``lr``, ``weight_decay``, ...) its constructor takes. A shared setting it does not take is
    left out unless the user set it (``OptimizerConfig.is_set``), and an error naming it when set."""
    path = _target_of(cfg._target_, "optimizer._target_")
    cls = locate_class(path, "optimizer._target_")
    takes, required = _takes(cls)
    kwargs = {}
    for key in SHARED_SETTINGS:
        value = getattr(cfg, key)
        if value is None:
            continue
        if takes is None or key in takes:
            kwargs[key] = tuple(value) if key == "betas" else value
        elif cfg.is_set(key):
            raise ConfigError(f"optimizer.{key}: {path} does not take '{key}'; remove it")
    args = plain(cfg.args)
    if "params" in args:
        raise ConfigError("optimizer.args.params: the framework passes the model's parameters; remove it")
    _check_args(path, "optimizer", args, takes, required - {"params"}, [*kwargs, *args])
    return cls, {**kwargs, **args}


def schedule_spec(cfg: OptimizerConfig) -> tuple[type, dict]:
    """The class of ``optimizer.schedule._target_`` and its keyword arguments (``optimizer.schedule.args``).
    The built-in schedules' settings (``name``, ``warmup_steps``, ``warmup_epochs``, ``min_lr``,
    ``min_lr_ratio``, ``plateau``'s) are errors when the user set them (``OptimizerConfig.is_set``); torch's
    ``ReduceLROnPlateau`` is refused for ``name=plateau``."""
    sched = cfg.schedule
    path = _target_of(sched._target_, "optimizer.schedule._target_")
    cls = locate_class(path, "optimizer.schedule._target_")
    if issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(f"optimizer.schedule._target_: {path} steps on a metric, which a _target_ scheduler is "
                          "never given; use optimizer.schedule.name=plateau (factor, patience, threshold, "
                          "cooldown, min_lr, monitor, mode), stepped at each evaluation and resumed exactly")
    for key in BUILTIN_SCHEDULE_SETTINGS:
        if cfg.is_set(f"schedule.{key}"):
            raise ConfigError(f"optimizer.schedule.{key}: only the built-in schedules use it, and "
                              f"optimizer.schedule._target_ is {path}; remove it")
    takes, required = _takes(cls)
    args = plain(sched.args)
    _check_args(path, "optimizer.schedule", args, takes, required, args)
    return cls, args
