"""Weights out of a run: ``csf.load_checkpoint`` reads a run's newest, best or named checkpoint for use
outside the framework (inference, fine-tuning elsewhere, export) and returns its model state dict with the
checkpoint's step, metrics and config. No model is built: the caller builds its own and loads the weights.

It reads through the same code as resume (the checkpoint package's ``store.resolve_checkpoint_path``,
``checkpoint_names``, ``read_best`` and ``format.read_checkpoint``): every file is untrusted, checked against its size and
checksums, read through no link and loaded as data only (``torch.load(weights_only=True)``, JSON, YAML). A
sharded (``strategy=fsdp``) checkpoint is consolidated in this process through the restricted DCP reader
(``backends.fsdp.read_model``); with no run there is no backend to ask, and DCP is the one sharded format
(``format.SHARD_NAME``), so this module, unlike the checkpoint plugin, names it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from .builtin.checkpoint.format import SHARDED, read_checkpoint, read_config_yaml
from .builtin.checkpoint.store import checkpoint_names, read_best, resolve_checkpoint_path
from .builtin.checkpoint.untrusted import yaml_problem
from .errors import CheckpointNotFound, DamagedCheckpoint, clipped

#: What ``which`` may name besides ``newest`` and ``best``: a checkpoint by its step, ``step-40`` or
#: ``step-00000040`` (the directory's name).
_STEP = re.compile(r"step-(\d{1,16})")  # at most 16 digits: a step is below 2**53
#: Prefixes a wrapper adds to every key of a model's state dict: ``DistributedDataParallel`` (``module.``),
#: ``torch.compile`` (``_orig_mod.``).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a run, read back by ``csf.load_checkpoint``."""

    path: Path
    """The checkpoint directory read (``<run dir>/checkpoints/step-<N>``)."""
    model: dict[str, torch.Tensor]
    """The model's state dict, on the CPU and whole (a sharded checkpoint consolidated), with the keys of
    the model ``model._target_`` builds: ``model.load_state_dict(checkpoint.model)``."""
    step: int
    """The global step it was saved at."""
    stage: str
    """The stage it was saved in (``main`` without ``stages``)."""
    metrics: dict[str, float]
    """The latest value of every metric when it was saved (``val/loss`` ...)."""
    config: dict[str, Any]
    """The run's composed config, as plain data (``config["model"]`` is what built the model)."""


def load_checkpoint(path: str | os.PathLike[str], which: str = "newest") -> Checkpoint:
    """The model weights and metadata of a run's checkpoint, for use outside the framework::

        ckpt = csf.load_checkpoint("outputs/my-run", which="best")
        model.load_state_dict(ckpt.model)

    ``path``: a run directory, its ``checkpoints/`` directory, or one checkpoint directory
    (``.../checkpoints/step-00000040``). ``which`` picks among a run's checkpoints: ``"newest"`` (the
    default), ``"best"`` (the one ``checkpoint.keep_best`` kept) or ``"step-<N>"``; a checkpoint directory
    is that checkpoint (``which`` left at ``"newest"``, or its own name).

    Raises ``CheckpointNotFound`` when ``path`` is no checkpoint, checkpoints/ or run directory or the run
    has no such checkpoint, ``DamagedCheckpoint`` naming the file when the checkpoint is incomplete,
    damaged or not plain data (nothing in it can run code), ``UnsafePathError`` when the run directory's
    ``checkpoints`` is a link (as resume refuses it), ``ValueError`` for any other ``which``.
    """
    if not isinstance(which, str):
        raise ValueError(f"load_checkpoint: which={which!r:.60}: give 'newest', 'best' or 'step-<N>' (a string)")
    target, is_root = resolve_checkpoint_path(Path(path))
    if not is_root:
        if which != "newest" and _step_name(which) != target.name:
            raise ValueError(f"load_checkpoint: which={clipped(repr(which))} picks among a run's checkpoints, and "
                             f"{target} is one checkpoint; give its run directory, or leave which at 'newest'")
        return _read(target)
    names = checkpoint_names(target)[0]  # the index is a hint, checked against the directory (as resume)
    chosen = _choose(target, names, which)
    try:
        return _read(target / chosen)
    except DamagedCheckpoint as e:  # no silent fallback to older weights: say which others there are
        others = [name for name in names if name != chosen]
        if not others:
            raise
        raise DamagedCheckpoint(f"{e}; the run's other checkpoints: {', '.join(others[-6:])} "
                                "(load one with which='step-<N>')") from e


def load_model(path: str | os.PathLike[str], which: str = "newest") -> torch.nn.Module:
    """The model of a run's checkpoint, rebuilt from the checkpoint's own config (its ``model`` section:
    ``_target_`` and arguments) and loaded with its weights, in evaluation mode::

        model = csf.load_model("outputs/my-run", which="best")
        preds = model((inputs, targets))["preds"]

    ``path`` and ``which`` as ``load_checkpoint``. The config is read as untrusted data: the model's
    ``_target_`` must name a ``torch.nn.Module`` class, and every nested one such a class or a class or
    function of the user's own code (``fixtures.mlp``), never one of Python's library or an installed
    package (``os.system``, ``subprocess.Popen``, ``torch.hub.load``); Hydra's ``_partial_``, ``_args_``,
    ``_recursive_``, ``_convert_`` and ``${...}`` interpolations are refused. The modules named are imported
    and the user's own functions called, so load only run directories whose code you trust. Raises
    ``DamagedCheckpoint`` naming the key of a config that is refused, ``ConfigError`` when its classes cannot
    be imported or built here, and what ``load_checkpoint`` raises."""
    from .targets import build

    checkpoint = load_checkpoint(path, which)
    spec = checkpoint.config.get("model")
    problem = _model_spec_problem(spec, "model")
    if problem:
        raise DamagedCheckpoint(f"checkpoint {checkpoint.path}: config.yaml's {problem}")
    model = build(spec, "model")
    if not isinstance(model, torch.nn.Module):  # the class said so; its constructor may return anything
        raise DamagedCheckpoint(f"checkpoint {checkpoint.path}: config.yaml's model built a {type(model).__name__}")
    try:
        model.load_state_dict(checkpoint.model)
    except RuntimeError as e:  # the weights are not the config's model's
        raise DamagedCheckpoint(f"checkpoint {checkpoint.path}: its weights do not fit the model its config "
                                f"builds ({_first_line(e)})") from e
    return model.eval()


#: A dotted name of Python identifiers (``torch.nn.Linear``).
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
#: Hydra's keys that would change what a ``_target_`` does (a partial function, positional arguments ...).
_HYDRA_KEYS = ("_partial_", "_args_", "_recursive_", "_convert_")


def _model_spec_problem(node: Any, key: str, top: bool = True) -> str | None:
    """Why ``node`` (a checkpoint's ``model`` config, untrusted) must not be built, or ``None``."""
    from .targets import find_target

    if top and not (isinstance(node, dict) and isinstance(node.get("_target_"), str)):
        return f"{key} has no _target_ (a class to build)"
    if isinstance(node, str) and "${" in node:  # OmegaConf would resolve it (oc.env reads the environment)
        return f"{key} holds an interpolation ({node!r:.60}), which is not rebuilt"
    if isinstance(node, list):
        return next(filter(None, (_model_spec_problem(v, f"{key}[{i}]", False) for i, v in enumerate(node))), None)
    if not isinstance(node, dict):
        return None
    for name in _HYDRA_KEYS:
        if name in node:
            return f"{key}.{name} is refused (only _target_ and arguments are rebuilt)"
    target = node.get("_target_")
    if target is not None:
        if not isinstance(target, str) or not _DOTTED.fullmatch(target):
            return f"{key}._target_ {str(target)!r:.60} is no dotted name of a class"
        found = find_target(target, f"{key}._target_")
        module_class = isinstance(found, type) and issubclass(found, torch.nn.Module)
        if top and not module_class:
            return f"{key}._target_ {target} is no torch.nn.Module class"
        if not module_class and not _users_own(found):
            return (f"{key}._target_ {target} is neither a torch.nn.Module class nor a class or function of your "
                    "own code (Python's library and installed packages are refused)")
    return next(filter(None, (_model_spec_problem(v, f"{key}.{k}", False) for k, v in node.items()
                              if k != "_target_")), None)


def _users_own(found: Any) -> bool:
    """Whether ``found`` (a class or function) is defined in a file of the user's own code: not Python's
    library, a builtin or an installed package (where ``subprocess.Popen`` or ``torch.hub.load`` live)."""
    import inspect

    from .targets import internal_file

    if not (isinstance(found, type) or inspect.isfunction(found)):
        return False
    try:
        filename = inspect.getfile(found)
    except TypeError:  # a builtin
        return False
    return not internal_file(filename) and "-packages" + os.sep not in os.path.realpath(filename)


def _choose(root: Path, names: list[str], which: str) -> str:
    """The checkpoint of ``root`` (a checkpoints/ directory holding ``names``) that ``which`` names."""
    name = _step_name(which)
    if which not in ("newest", "best") and name is None:
        raise ValueError(f"load_checkpoint: which={clipped(repr(which))}: give 'newest', 'best' or 'step-<N>'")
    held = f"it holds {_listed(names)}" if names else "it holds no complete checkpoint"
    if which == "newest":
        if not names:
            raise CheckpointNotFound(f"{root}: {held} (the run saved none: checkpoint.every_steps, "
                                     "checkpoint.save_at_end)")
        return names[-1]
    if which == "best":
        best = read_best(root)
        if best is None:
            raise CheckpointNotFound(f"{root}: no best checkpoint was kept (train with "
                                     f"checkpoint.keep_best.monitor=<metric> to keep one); {held}")
        return best["name"]
    if name not in names:
        raise CheckpointNotFound(f"{root / str(name)}: no such checkpoint; {held}")
    return str(name)


def _step_name(which: str) -> str | None:
    """The checkpoint directory ``which`` names by its step (``step-40``: ``step-00000040``), if it does."""
    named = _STEP.fullmatch(which)
    return f"step-{int(named.group(1)):08d}" if named else None


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[-6:])
    return f"{len(names)} checkpoint(s): {'..., ' if len(names) > 6 else ''}{shown}"


def _read(path: Path) -> Checkpoint:
    """Read and check one checkpoint directory (``read_checkpoint``), consolidating a sharded model."""
    state, meta = read_checkpoint(path, _read_shard_metadata)
    if state.get("sharded"):
        from .backends import fsdp

        files = {name.split("/", 1)[1] for name in meta["files"] if name.startswith(SHARDED + "/")}
        try:
            model = fsdp.read_model(path / SHARDED, files)
        except Exception as e:  # noqa: BLE001 - whatever the shards make DCP raise, the checkpoint is damaged
            raise DamagedCheckpoint(f"checkpoint {path}: refused to load {SHARDED}/ "
                                    f"({type(e).__name__}: {_first_line(e)})") from e
    else:
        model = state["model"]
    if not (isinstance(model, dict) and all(isinstance(k, str) and (isinstance(v, torch.Tensor)
                                                                    or k.endswith("_extra_state"))
                                            for k, v in model.items())):
        raise DamagedCheckpoint(f"checkpoint {path}: its model is not a state dict of tensors")
    loop = state.get("loop")
    step = loop.get("global_step") if isinstance(loop, dict) else None
    if type(step) is not int or step < 0:
        raise DamagedCheckpoint(f"checkpoint {path}: state.pt holds no step (loop.global_step)")
    stage = meta.get("stage")
    return Checkpoint(path=path, model=unwrapped(model), step=step,
                      stage=stage if isinstance(stage, str) else "", metrics=dict(meta.get("metrics") or {}),
                      config=_config(path))


def _read_shard_metadata(path: Path) -> None:
    from .backends import fsdp

    fsdp.read_metadata(path)


def _config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.yaml as plain data, checked from the parser's events before it is built (a
    checkpoint without one: empty)."""
    text = read_config_yaml(path)
    problem = yaml_problem(text)
    if problem:
        raise DamagedCheckpoint(f"checkpoint {path}: config.yaml is damaged ({problem})")
    config = yaml.safe_load(text) if text else {}
    return config if isinstance(config, dict) else {}


def unwrapped(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model`` with the prefix a wrapper put on every key removed (``module.`` of DDP, ``_orig_mod.`` of
    ``torch.compile``, nested in any order), so it loads into the plain model."""
    while model:
        prefix = next((p for p in _WRAPPER_PREFIXES if all(k.startswith(p) for k in model)), None)
        if prefix is None:
            break
        model = {k[len(prefix):]: v for k, v in model.items()}
    return model


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""

