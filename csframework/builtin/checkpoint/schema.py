"""The run state a checkpoint holds (``state.pt``, what ``Run.state_dict`` returns), as one list of fields.

Each ``Field`` of ``FIELDS`` says how its value is taken from a run (``save``), checked against this run's
config when read back (``check``: a checkpoint is untrusted input, ``readback`` holds the range rules) and
put back into a run (``load``); writing, reading and checking all walk that one list, in its order. Every
field is always written (``None`` where a run has no such part). A state of an older layout is converted to
this one by ``upgrade``, one ``_convert_v<n>_to_v<n+1>`` per version, before anything else reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...config.schema import plugin_sections
from ...data import is_iterable
from ...errors import ConfigError, DamagedCheckpoint
from ...param_groups import resume_problem
from ...protocol import LoopRun
from ...rng import rng_state, set_rng_state
from .readback import PAST_THE_STAGE, optimizer_problems, position_problems, saved_group_count, scaler_problems, schedule_problems

#: The layout ``Run.state_dict`` writes; older ones are converted on load (``upgrade``), newer ones refused.
STATE_VERSION = 2
#: The ``RunState`` fields that locate a run in its stages (``state["loop"]``, with the stage's name and the
#: stop record).
POSITION = ("global_step", "stage_index", "stage_step", "epoch", "batch_in_epoch", "micro_step", "last_eval_step")


class StateMismatch(ConfigError):
    """A checkpoint's state is sound but belongs to another run (another model, parameter groups, strategy or
    stages): ``field`` names the part, ``why`` says how (the checkpoint plugin adds the checkpoint's path)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"checkpoint: {why}")
        self.field, self.why = field, why


@dataclass(frozen=True)
class Field:
    """One entry of ``state.pt``."""

    key: str
    save: Callable[[LoopRun, dict], Any]
    """Its value for a run (the second argument: the backend's whole model and optimizer state, when not
    sharded: ``Backend.checkpoint_state`` hands out both at once)."""
    check: Callable[[LoopRun, dict], list[str]]
    """What in a read-back state's value this run's config refuses (the whole state given: some rules depend
    on other fields); a problem makes the checkpoint damaged."""
    load: Callable[[LoopRun, dict], None]
    """Put the value back into the run (``StateMismatch`` when it belongs to another run)."""


# -- the parts --------------------------------------------------------------------------------------------
def _save_loop(run: LoopRun, _: dict) -> dict:
    stopped = run.stop_reason is not None
    return {**{key: getattr(run, key) for key in POSITION}, "stage": run.stage,
            "stop_reason": run.stop_reason, "stop_settings": _stop_settings(run) if stopped else None}


def _check_loop(run: LoopRun, state: dict) -> list[str]:
    found = position_problems(run, state["loop"])
    if not found:
        loop = state["loop"]
        found += [f"loop.{key} is not a string" for key in ("stage", "stop_reason", "stop_settings")
                  if not isinstance(loop.get(key), str) and not (key != "stage" and loop.get(key) is None)]
    return found


def _load_loop(run: LoopRun, state: dict) -> None:
    """Enter the saved stage, then its position; a stopped run stays stopped unless what decides a stop
    changed (``_stop_settings``)."""
    loop, names = state["loop"], [name for name, _ in run.stages]
    if names[loop["stage_index"]] != loop["stage"]:
        raise StateMismatch("loop", f"it was saved in stage '{loop['stage']}', which this run does not have at "
                                    f"that position (stages: {names})")
    if loop["stage_index"] != run.stage_index:
        run.enter_stage(loop["stage_index"])
    for key in POSITION:
        setattr(run.state, key, loop[key])
    if loop["stop_reason"] is not None and loop["stop_settings"] == _stop_settings(run):
        run.state.stop_reason = loop["stop_reason"]  # finished means finished: loop.finished says so


def _load_sharded(run: LoopRun, state: dict) -> None:
    if state["sharded"] != run.backend.sharded:
        how = "sharded (strategy=fsdp)" if state["sharded"] else "whole (strategy single or ddp)"
        raise StateMismatch("sharded", f"it was written {how}; resume it with the same kind of strategy")


def _load_param_groups(run: LoopRun, state: dict) -> None:
    """Refuse optimizer state of other parameter groups: torch would load it by position, giving one group's
    state and settings to another's parameters. A model that does not fit is named first (``_load_model``):
    its groups differ because its parameters do."""
    saved, optimizer = state["param_groups"], state["optimizer"]
    if isinstance(state["model"], dict) and model_mismatch(run.model, state["model"]):
        return
    problem = resume_problem(saved, run.param_groups)
    if saved is None and optimizer is not None and len(optimizer["param_groups"]) != len(run.param_groups):
        problem = (f"it has {len(optimizer['param_groups'])} parameter group(s), this run {len(run.param_groups)} "
                   "(its groups were not recorded: it predates optimizer.weight_decay_exclude, whose default "
                   "leaves biases and norm scales undecayed)")
    if problem:
        raise StateMismatch("param_groups", f"{problem}; resume it with the optimizer.groups and "
                            "optimizer.weight_decay_exclude it was saved with (optimizer.weight_decay_exclude=[] "
                            "decays every parameter, as before that setting), or start a new run")


def model_mismatch(model: torch.nn.Module, saved: dict) -> list[str]:
    """How ``saved`` (a model state dict) does not fit ``model``: missing, unexpected or reshaped tensors."""
    current = model.state_dict()
    problems = []
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing:
        problems.append(f"the model has {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
                        + " which the checkpoint lacks")
    if unexpected:
        problems.append(f"the checkpoint has {unexpected[0]}"
                        + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else "") + " which the model lacks")
    for key, value in current.items():
        if key in saved and hasattr(saved[key], "shape") and tuple(saved[key].shape) != tuple(value.shape):
            problems.append(f"{key} is {list(saved[key].shape)} in the checkpoint, {list(value.shape)} in the model")
            break
    return problems


def _check_model(_: LoopRun, state: dict) -> list[str]:
    model = state["model"]
    if state["sharded"]:  # its shards are in sharded/, checked by the backend
        return [] if model is None else ["model: a sharded checkpoint keeps it in sharded/"]
    if not (isinstance(model, dict) and all(isinstance(k, str) and (isinstance(v, torch.Tensor)
                                                                    or k.endswith("_extra_state"))
                                            for k, v in model.items())):
        return ["model: it is not a state dict of tensors"]
    return []


def _load_model(run: LoopRun, state: dict) -> None:
    if state["model"] is None:  # sharded: the checkpoint plugin loads it (Backend.load_sharded)
        return
    problems = model_mismatch(run.model, state["model"])  # the one check: after it, a strict load fits
    if problems:
        raise StateMismatch("model", "; ".join(problems))
    run.model.load_state_dict(state["model"])


def _load_optimizer(run: LoopRun, state: dict) -> None:
    if state["optimizer"] is not None:
        run.optimizer.load_state_dict(state["optimizer"])


def plain_rates(state: dict) -> dict:
    """An optimizer's ``state_dict`` with its learning rates as numbers: ``backend.compile`` keeps them in
    tensors, and a checkpoint loads into any backend (``state_dict`` copies each group, so the live tensors
    stay)."""
    for group in state.get("param_groups", ()):
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
    return state


def _save_data(run: LoopRun, _: dict) -> dict | None:
    """The training dataset's own state, for an ``IterableDataset`` that has one and is read in this process
    (``data.num_workers=0``); otherwise resume re-reads the epoch to its position. ``pass_ended``: a short
    last batch made the dataset's iterator end, so its state is already the next pass's."""
    loader = run.train_loader
    if is_iterable(loader) and loader.num_workers == 0 and loader.dataset.stateful():
        return {"state": loader.dataset.state_dict(), "pass_ended": bool(loader.dataset.pass_ended)}
    return None


def _load_data(run: LoopRun, state: dict) -> None:
    data, loader = state["data"], run.train_loader
    if data is not None and is_iterable(loader) and loader.num_workers == 0:
        loader.dataset.load_state_dict(data["state"], pass_ended=data["pass_ended"])


def _load_carried(run: LoopRun, state: dict) -> None:
    if run.carried is not None:  # a stateful model: where its state was (none saved: a pass's start)
        device = next(iter(run.model.parameters()), torch.empty(0)).device
        run.carried.load_state_dict(state["carried"], device)


def _is(kind: type, key: str, optional: bool = False) -> Callable[[LoopRun, dict], list[str]]:
    """A check that the field ``key`` is a ``kind`` (or ``None``, if ``optional``)."""
    def check(_: LoopRun, state: dict) -> list[str]:
        value = state[key]
        ok = type(value) is kind if kind is bool else isinstance(value, kind)
        return [] if ok or (optional and value is None) else [f"{key}: {type(value).__name__} is not a {kind.__name__}"]
    return check


def _no_check(_: LoopRun, __: dict) -> list[str]:
    return []


def _check_data(_: LoopRun, state: dict) -> list[str]:
    data = state["data"]
    if data is None or (isinstance(data, dict) and set(data) == {"state", "pass_ended"}
                        and type(data["pass_ended"]) is bool):
        return []
    return ["data: it is not a table of state and pass_ended"]


def _check_param_groups(_: LoopRun, state: dict) -> list[str]:
    groups = state["param_groups"]
    if groups is None or (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
        return []
    return ["param_groups: it is not a list of tables"]


#: The run state, in the order it is checked and loaded: the strategy and the stage first (entering the
#: saved stage builds its optimizer and schedule), then what fills them.
FIELDS = (
    Field("sharded", lambda run, _: run.backend.sharded, _is(bool, "sharded"), _load_sharded),
    Field("loop", _save_loop, _check_loop, _load_loop),
    Field("param_groups", lambda run, _: [g.describe() for g in run.param_groups], _check_param_groups,
          _load_param_groups),
    Field("model", lambda _, whole: whole.get("model"), _check_model, _load_model),
    Field("optimizer", lambda _, whole: whole.get("optimizer"),
          lambda _, state: [] if state["sharded"] else optimizer_problems(state["optimizer"]), _load_optimizer),
    Field("scheduler", lambda run, _: run.scheduler.state_dict(),
          lambda run, state: schedule_problems(state["scheduler"], saved_group_count(run, state)),
          lambda run, state: run.scheduler.load_state_dict(state["scheduler"])),
    Field("backend", lambda run, _: run.backend.state_dict(),
          lambda _, state: (scaler_problems(state["backend"].get("precision")) if isinstance(state["backend"], dict)
                            else ["backend: it is not a table"]),
          lambda run, state: run.backend.load_state_dict(state["backend"])),
    Field("rng", lambda _, __: rng_state(), _is(dict, "rng"), lambda _, state: set_rng_state(state["rng"])),
    Field("carried", lambda run, _: run.carried.state_dict() if run.carried is not None else None,
          _no_check, _load_carried),
    Field("data", _save_data, _check_data, _load_data),
)
KEYS = ("version", *(field.key for field in FIELDS))


# -- write, read, check, load -------------------------------------------------------------------------------
def run_state(run: LoopRun) -> dict:
    """Everything that decides the rest of ``run``, as tensors and plain values (loadable with
    ``torch.load(weights_only=True)``): every field of ``FIELDS``. Under ``strategy=fsdp`` the model and
    optimizer are ``None``: every rank writes its shards of them (``Backend.save_sharded``)."""
    whole: dict = {}
    if not run.backend.sharded:
        model, optimizer = run.backend.checkpoint_state(run.model, run.optimizer)
        whole = {"model": model, "optimizer": plain_rates(optimizer)}
    return {"version": STATE_VERSION, **{field.key: field.save(run, whole) for field in FIELDS}}


def upgrade(state: Any, where: str = "checkpoint") -> dict:
    """``state`` (read from a checkpoint) in this layout: converted from an older version, its fields
    checked to be the ones of ``FIELDS``. ``DamagedCheckpoint`` (its message begins with ``where``) when it is
    not a run state of any version, ``ConfigError`` when a newer csframework wrote it."""
    version = state.get("version") if isinstance(state, dict) else None
    if type(version) is not int or version < 1:
        raise DamagedCheckpoint(f"{where}: state.pt holds no run state (no layout version)")
    if version > STATE_VERSION:
        raise ConfigError(f"{where}: its state has layout version {version}, this csframework reads versions 1 "
                          f"to {STATE_VERSION}: resume it with the csframework that wrote it, or a newer one")
    try:
        while state["version"] < STATE_VERSION:
            state = _CONVERTERS[state["version"]](state)
    except (KeyError, TypeError, AttributeError) as e:  # a forged older layout
        raise DamagedCheckpoint(f"{where}: state.pt is not a run state of layout version {version} "
                                f"({type(e).__name__}: {e})") from e
    missing, unknown = set(KEYS) - set(state), set(state) - set(KEYS)
    if missing or unknown:
        raise DamagedCheckpoint(f"{where}: state.pt is not a run state of layout version {STATE_VERSION} ("
                                + "; ".join(f"{what}: {', '.join(sorted(map(str, keys)))}" for what, keys
                                            in (("missing", missing), ("unknown", unknown)) if keys) + ")")
    return state


class TrainedFurther(DamagedCheckpoint):
    """A checkpoint whose only fault is a position past this config's steps (``PAST_THE_STAGE``): a run trained
    longer than ``loop.max_steps`` now says, or a forged position. ``step``: the global step it holds;
    ``problem``: the position's, with the setting to raise."""

    def __init__(self, message: str, step: int, problem: str):
        super().__init__(message)
        self.step, self.problem = step, problem


def checked_state(run: LoopRun, state: Any, where: str = "checkpoint") -> dict:
    """``upgrade(state)``, each field checked against this run's config (``Field.check``);
    ``DamagedCheckpoint`` naming every value it refuses, each by its key in the state (``TrainedFurther``
    when the only one is a position past this config's steps)."""
    state = upgrade(state, where)
    found = [problem for field in FIELDS for problem in field.check(run, state)]
    if found:
        message = f"{where}: state.pt holds values this run's config refuses ({'; '.join(found)})"
        if all(PAST_THE_STAGE in problem for problem in found):
            raise TrainedFurther(message, state["loop"]["global_step"], found[0])
        raise DamagedCheckpoint(message)
    return state


def load_run_state(run: LoopRun, state: Any) -> None:
    """Continue ``run`` from a saved state (of any version ``upgrade`` converts, checked by
    ``checked_state``): every field, in order."""
    state = checked_state(run, state)
    for field in FIELDS:
        field.load(run, state)


# -- older layouts ------------------------------------------------------------------------------------------
def _convert_v1_to_v2(state: dict) -> dict:
    """Version 1 (csframework before issue 51) wrote ``sharded``, ``carried``, ``data_pass_ended`` and the
    stop record only when set, and no ``model``/``optimizer`` when sharded; its oldest checkpoints have no
    ``last_eval_step`` (no evaluation recorded: -1) and no ``param_groups`` (``None``: not recorded, so only
    the optimizer's group count is compared)."""
    sharded = state.get("sharded", False)
    data = state.get("data")
    return {"version": 2, "sharded": sharded,
            "loop": {"last_eval_step": -1, "stop_reason": None, "stop_settings": None, **state["loop"]},
            "param_groups": state.get("param_groups"),
            "model": None if sharded else state["model"], "optimizer": None if sharded else state["optimizer"],
            "scheduler": state["scheduler"], "backend": state["backend"], "rng": state["rng"],
            "carried": state.get("carried"),
            "data": None if data is None else {"state": data, "pass_ended": state.get("data_pass_ended", False)}}


_CONVERTERS: dict[int, Callable[[dict], dict]] = {1: _convert_v1_to_v2}


# -- the stop record ------------------------------------------------------------------------------------------
def _stop_settings(run: LoopRun) -> str:
    """What may decide a stop, as a string to compare: the plugins (by name), their config sections
    (``early_stopping.patience`` ...) and the stage's ``loop`` settings. Saved with a stop's reason, which a
    resumed run keeps only under the same settings: a stopped run is complete unless they changed."""
    cfg, pm = run.stage_config, run.hooks.pm
    plugins = sorted(str(pm.get_name(p)) for p in pm.get_plugins())
    return repr({"plugins": plugins, "loop": cfg.loop, **{name: getattr(cfg, name) for name in plugin_sections(cfg)}})
