"""The optimizer's parameter groups, from ``optimizer.groups`` and ``optimizer.weight_decay_exclude``.

Each parameter joins the first named group with a pattern matching its name, else the default group; within
a group without its own ``weight_decay``, the parameters ``weight_decay_exclude`` names form a ``no_decay``
part (only when the decay rate is not 0: a rate of 0 has nothing to exclude). The groups' description
(names, members, settings) goes into checkpoints, and a resumed run must have the same groups.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from .config import OptimizerConfig
from .config.optimizer import BELOW_2D, param_group_configs
from .errors import ConfigError

DEFAULT = "default"
NO_DECAY = "no_decay"


@dataclass
class ParamGroup:
    """One of the optimizer's param groups: its name, members (by name) and settings."""

    name: str
    lr_scale: float
    weight_decay: float
    names: list[str] = field(default_factory=list)
    params: list[torch.nn.Parameter] = field(default_factory=list)

    def describe(self) -> dict:
        """What a checkpoint records of this group (plain values)."""
        return {"name": self.name, "lr_scale": self.lr_scale, "weight_decay": self.weight_decay,
                "params": list(self.names)}

    def summary(self) -> str:
        """One line for the start event: ``name: tensors, parameters, settings``."""
        count = sum(p.numel() for p in self.params)
        scale = f", lr x{self.lr_scale:g}" if self.lr_scale != 1.0 else ""
        return f"{self.name}: {len(self.params)} tensors, {count} params, weight_decay {self.weight_decay:g}{scale}"


def _matches(name: str, param: torch.Tensor, pattern: str) -> bool:
    if pattern == BELOW_2D:
        return param.dim() < 2
    return fnmatch.fnmatchcase(name, pattern)


def _unused(patterns: list[str], names: list[str], params: list[torch.nn.Parameter], key: str) -> None:
    """A ``ConfigError`` naming the first pattern of ``key`` that matches no parameter (``ndim<2`` excepted:
    a model may have no bias)."""
    for pattern in patterns:
        if pattern != BELOW_2D and not any(_matches(n, p, pattern) for n, p in zip(names, params)):
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ConfigError(f"{key}: the pattern '{pattern}' matches no parameter of the model "
                              f"(its parameters: {shown}); fix or remove it")


def parameter_groups(named: list[tuple[str, torch.nn.Parameter]], cfg: OptimizerConfig,
                     weight_decay: float) -> list[ParamGroup]:
    """The groups of the parameters ``named`` under ``cfg``, in a fixed order (the named groups, then the
    default one, each followed by its ``no_decay`` part); groups without members are left out. Frozen
    parameters are kept, as ``model.parameters()`` keeps them: a plugin may unfreeze them later.
    ``weight_decay`` is the optimizer's own rate (``optimizer.weight_decay``, or a ``_target_``'s
    ``args.weight_decay``)."""
    named = list(named)
    names, params = [n for n, _ in named], [p for _, p in named]
    exclude = list(cfg.weight_decay_exclude)
    _unused(exclude, names, params, "optimizer.weight_decay_exclude")
    try:
        settings = param_group_configs(cfg.groups)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    for group_name, spec in settings.items():
        if not spec.params:
            raise ConfigError(f"optimizer.groups.{group_name}.params: empty; list the name patterns of its "
                              "parameters (e.g. ['encoder.*'])")
        _unused(list(spec.params), names, params, f"optimizer.groups.{group_name}.params")
    for group_name in settings:
        if group_name in (DEFAULT, NO_DECAY) or "/" in group_name:
            raise ConfigError(f"optimizer.groups.{group_name}: '{DEFAULT}', '{NO_DECAY}' and names with '/' are "
                              "the framework's own group names; name it otherwise")
    order = [*settings, DEFAULT]
    groups: dict[tuple[int, bool], ParamGroup] = {}  # (its owner's place in order, excluded from decay)
    for name, param in named:
        owner = next((g for g, spec in settings.items()
                      if any(_matches(name, param, pat) for pat in spec.params)), None)
        group_spec = settings[owner] if owner is not None else None
        scale = group_spec.lr_scale if group_spec is not None else 1.0
        rate = group_spec.weight_decay if group_spec is not None else None
        label, excluded = owner or DEFAULT, False
        if rate is None:
            rate = weight_decay
            if rate != 0 and any(_matches(name, param, pat) for pat in exclude):
                label, rate, excluded = (NO_DECAY if owner is None else f"{owner}/{NO_DECAY}"), 0.0, True
        group = groups.setdefault((order.index(owner or DEFAULT), excluded),
                                  ParamGroup(label, float(scale), float(rate)))
        group.names.append(name)
        group.params.append(param)
    return [groups[key] for key in sorted(groups)]


def optimizer_params(groups: list[ParamGroup], lr: float | None, weight_decay: float) -> list[dict]:
    """``groups`` as torch param groups: each sets the ``lr`` (when it has a scale; ``lr`` is the optimizer's)
    and ``weight_decay`` (when not the optimizer's) it differs in, and carries its ``name``."""
    out = []
    for group in groups:
        entry: dict = {"params": group.params, "name": group.name}
        if group.lr_scale != 1.0 and lr is not None:
            entry["lr"] = lr * group.lr_scale
        if group.weight_decay != weight_decay:
            entry["weight_decay"] = group.weight_decay
        out.append(entry)
    return out


def resume_problem(saved: list[dict] | None, groups: list[ParamGroup]) -> str | None:
    """Why a checkpoint whose groups are ``saved`` (``None``: a checkpoint from before groups were recorded)
    cannot resume a run with ``groups``, or ``None`` when they have the same names and members. Their
    settings may differ: the optimizer's state restores the checkpoint's rates and decays, as for every
    optimizer setting (the checkpoint plugin warns of a changed one)."""
    now = [g.describe() for g in groups]
    if saved is None or saved == now:
        return None
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        return "its parameter groups are unreadable"
    then = {g.get("name"): g for g in saved}
    for group in now:
        old = then.get(group["name"])
        if old is None:
            return (f"this run has the parameter group '{group['name']}' ({len(group['params'])} tensors), "
                    f"which the checkpoint lacks (its groups: {', '.join(str(n) for n in then)})")
        if old.get("params") != group["params"]:
            return f"the parameter group '{group['name']}' has other members than in the checkpoint"
    gone = [str(n) for n in then if n not in {g["name"] for g in now}]
    if gone:
        return f"the checkpoint has the parameter group '{gone[0]}', which this run lacks"
    if [g["name"] for g in now] != [g.get("name") for g in saved]:  # torch loads the groups by position
        return "its parameter groups are in another order (optimizer.groups' order changed)"
    return None
