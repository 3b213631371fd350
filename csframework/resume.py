"""What a checkpoint holds of a run and how a run continues from it: ``Run.state_dict`` and
``Run.load_state_dict`` (the checkpoint plugin writes and reads the files)."""
from __future__ import annotations

from typing import Any

import torch

from .config.schema import plugin_sections
from .data import is_iterable
from .errors import ConfigError
from .param_groups import resume_problem
from .protocol import RunProtocol
from .rng import rng_state, set_rng_state

#: The layout of ``state_dict()``; a checkpoint of another layout is refused on load.
STATE_VERSION = 1


def run_state(run: RunProtocol) -> dict:
    """Everything that decides the rest of ``run``, as tensors and plain values (loadable with
    ``torch.load(weights_only=True)``). Under ``strategy=fsdp`` the model and optimizer are not in it
    (``sharded``): every rank writes its shards of them (``Backend.save_sharded``)."""
    data = _data_state(run)
    # a short last batch made the dataset's iterator end: its state is already the next pass's
    pass_ended = data is not None and run.train_loader.dataset.pass_ended
    whole: dict[str, Any]
    if run.backend.sharded:
        whole = {"sharded": True}
    else:
        model, optimizer = run.backend.checkpoint_state(run.model, run.optimizer)
        whole = {"model": model, "optimizer": plain_rates(optimizer)}
    return {
        "version": STATE_VERSION,
        **whole,
        "param_groups": [group.describe() for group in run.param_groups],
        "scheduler": run.scheduler.state_dict(),
        "backend": run.backend.state_dict(),
        "loop": dict(run.state.position(), stage=run.stage, **_stop_record(run)),
        "rng": rng_state(),
        "data": data,
        **({"data_pass_ended": True} if pass_ended else {}),
        **({"carried": run.state.carried.state_dict()} if run.state.carried is not None else {}),
    }


def load_run_state(run: RunProtocol, state: dict) -> None:
    """Continue ``run`` from ``run_state``'s ``state``: enters the saved stage and restores every piece."""
    if state.get("version") != STATE_VERSION:
        raise ConfigError(f"checkpoint: its state has layout version {state.get('version')}, this "
                          f"csframework reads version {STATE_VERSION}")
    position = state["loop"]
    names = [name for name, _ in run.stages]
    if position["stage_index"] >= len(names) or names[position["stage_index"]] != position["stage"]:
        raise ConfigError(f"checkpoint: it was saved in stage '{position['stage']}', which this run "
                          f"does not have at that position (stages: {names})")
    if position["stage_index"] != run.state.stage_index:
        run.enter_stage(position["stage_index"])
    _check_param_groups(run, state)
    if not state.get("sharded"):  # sharded: the checkpoint plugin loads them (Backend.load_sharded)
        try:
            run.model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise ConfigError(f"checkpoint: the model does not match this run's model: {e}") from e
        run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.backend.load_state_dict(state["backend"])
    run.state.restore_position(position)
    reason = position.get("stop_reason")
    if isinstance(reason, str) and position.get("stop_settings") == _stop_settings(run):
        run.state.stop_reason = reason  # finished means finished: loop.finished says so
    set_rng_state(state["rng"])
    if run.state.carried is not None:  # a stateful model: where its state was (none saved: a pass's start)
        device = next(iter(run.model.parameters()), torch.empty(0)).device
        run.state.carried.load_state_dict(state.get("carried"), device)
    loader = run.train_loader
    if state.get("data") is not None and is_iterable(loader) and loader.num_workers == 0:
        loader.dataset.load_state_dict(state["data"], pass_ended=state.get("data_pass_ended", False))


def plain_rates(state: dict) -> dict:
    """An optimizer's ``state_dict`` with its learning rates as numbers: ``backend.compile`` keeps them in
    tensors, and a checkpoint loads into any backend (``state_dict`` copies each group, so the live tensors
    stay)."""
    for group in state.get("param_groups", ()):
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
    return state


def _check_param_groups(run: RunProtocol, state: dict) -> None:
    """Refuse a checkpoint whose optimizer state belongs to other parameter groups: torch would load it by
    position, giving one group's state and settings to another's parameters."""
    problem = resume_problem(state.get("param_groups"), run.param_groups)
    saved = state.get("optimizer", {}).get("param_groups") if not state.get("sharded") else None
    if problem is None and state.get("param_groups") is None and saved is not None \
            and len(saved) != len(run.param_groups):
        problem = (f"it has {len(saved)} parameter group(s), this run {len(run.param_groups)} (it predates "
                   "optimizer.weight_decay_exclude, whose default now leaves biases and norm scales undecayed)")
    if problem:
        raise ConfigError(f"checkpoint: {problem}; resume it with the optimizer.groups and "
                          "optimizer.weight_decay_exclude it was saved with (optimizer.weight_decay_exclude=[] "
                          "decays every parameter, as before that setting), or start a new run")


def _stop_settings(run: RunProtocol) -> str:
    """What may decide a stop, as a string to compare: the plugins (by name), their config sections
    (``early_stopping.patience`` ...) and the stage's ``loop`` settings."""
    cfg, pm = run.stage_config, run.hooks.pm
    plugins = sorted(str(pm.get_name(p)) for p in pm.get_plugins())
    return repr({"plugins": plugins, "loop": cfg.loop, **{name: getattr(cfg, name) for name in plugin_sections(cfg)}})


def _stop_record(run: RunProtocol) -> dict[str, str]:
    """After ``request_stop``: why, and the settings the run stopped under (``_stop_settings``), which a
    resumed run compares with its own (``load_run_state``): a stopped run is complete unless they changed."""
    if run.stop_reason is None:
        return {}
    return {"stop_reason": run.stop_reason, "stop_settings": _stop_settings(run)}


def _data_state(run: RunProtocol) -> dict | None:
    """The training dataset's own state, for an ``IterableDataset`` that has one and is read in this
    process (``data.num_workers=0``); otherwise resume re-reads the epoch to its position."""
    loader = run.train_loader
    if is_iterable(loader) and loader.num_workers == 0 and loader.dataset.stateful():
        return loader.dataset.state_dict()
    return None
