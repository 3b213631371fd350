"""The checkpoint plugin: save every ``checkpoint.every_steps`` and at the end of each stage, keep the
newest ``keep_last``, and resume (``checkpoint.resume=auto`` or a path).

A checkpoint is a directory ``checkpoints/step-<global step>/`` holding
``state.pt`` (tensors and plain values only, loaded with ``torch.load(weights_only=True)``, so loading
cannot run code), ``meta.json`` (step, stage, plugin state, a SHA-256 of ``state.pt``) and ``config.yaml``
(the composed run config). It is written under a temporary name, fsynced and renamed, so it is complete or
absent; ``checkpoints/index.json`` lists the complete ones, newest last, and is replaced last.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..errors import ConfigError
from ..plugins import hookimpl
from .metrics import write_json_atomic

INDEX = "index.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(root: Path, name: str, state: dict, meta: dict, config_yaml: str) -> Path:
    """Write one checkpoint atomically into ``root/name``; returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    meta = dict(meta, sha256={"state.pt": sha256(tmp / "state.pt")})
    write_json_atomic(tmp / "meta.json", meta)
    with open(tmp / "config.yaml", "w", encoding="utf-8") as f:
        f.write(config_yaml)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a resumed run's end): replace it whole
        old = root / f".old-{name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    return final


def read_checkpoint(path: Path) -> tuple[dict, dict]:
    """``(state, meta)`` of a checkpoint directory, after checking its checksum.

    Raises ``ValueError`` naming the path when it is incomplete or damaged.
    """
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        expected = meta["sha256"]["state.pt"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"checkpoint {path}: meta.json is missing or damaged ({e})") from e
    state_file = path / "state.pt"
    if not state_file.exists() or sha256(state_file) != expected:
        raise ValueError(f"checkpoint {path}: state.pt is missing or damaged (checksum mismatch)")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:  # a file that passes the checksum but holds code is refused here
        raise ValueError(f"checkpoint {path}: refused to load ({type(e).__name__}: {e})") from e
    return state, meta


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first: from the index, else from the directory names."""
    try:
        names = json.loads((root / INDEX).read_text(encoding="utf-8"))["checkpoints"]
    except (OSError, ValueError, KeyError, TypeError):
        names = sorted(p.name for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []
    return [root / n for n in names if (root / n).is_dir()]


class CheckpointPlugin:
    name = "checkpoint"

    def __init__(self):
        self.saved_step = None
        self.seen_step = None

    def _root(self, run) -> Path:
        return run.output_dir / "checkpoints"

    @hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        resume = run.config.checkpoint.resume
        if resume == "never":
            return
        root = self._root(run)
        candidates = list(reversed(list_checkpoints(root))) if resume == "auto" else [Path(resume)]
        for path in candidates:
            try:
                state, meta = read_checkpoint(path)
            except ValueError as e:
                if resume != "auto":
                    raise ConfigError(f"checkpoint.resume: {e}") from e
                run.log.warning("checkpoint_damaged", path=str(path), error=str(e),
                                action="falling back to the previous checkpoint")
                continue
            run.load_state_dict(state)
            run.hooks.on_checkpoint_load(run=run, state=meta.get("plugins", {}))
            self.saved_step = self.seen_step = run.global_step
            run.log.info("resumed", path=str(path), step=run.global_step, stage=run.stage)
            return
        if resume == "auto" and candidates:
            run.log.warning("no_good_checkpoint", directory=str(root), action="starting from scratch")

    @hookimpl
    def on_train_start(self, run):
        self.seen_step = run.global_step  # a step ends when the global step moves past this

    @hookimpl(trylast=True)
    def on_train_batch_end(self, run):
        every = run.stage_config.checkpoint.every_steps
        step = run.global_step
        if step == self.seen_step:  # not the last batch of a step
            return
        self.seen_step = step
        if every and step % every == 0:
            self.save(run)

    @hookimpl
    def on_train_end(self, run):
        if run.stage_config.checkpoint.save_at_end and self.saved_step != run.global_step:
            self.save(run)

    def save(self, run) -> Path | None:
        """Write a checkpoint of ``run`` now (rank 0 only) and prune to ``keep_last``."""
        if run.rank != 0:
            return None
        root = self._root(run)
        plugin_state: dict = {}
        run.hooks.on_checkpoint_save(run=run, state=plugin_state)
        meta = {"global_step": run.global_step, "stage": run.stage, "plugins": plugin_state,
                "metrics": dict(run.metrics), "run_id": run.run_id}
        config_yaml = OmegaConf.to_yaml(OmegaConf.structured(dataclasses.replace(run.config)))
        name = f"step-{run.global_step:08d}"
        path = write_checkpoint(root, name, run.state_dict(), meta, config_yaml)
        kept = [p.name for p in list_checkpoints(root) if p.name != name] + [name]
        keep = run.stage_config.checkpoint.keep_last
        write_json_atomic(root / INDEX, {"checkpoints": kept[-keep:]})
        for old in kept[:-keep]:
            shutil.rmtree(root / old, ignore_errors=True)
        self.saved_step = run.global_step
        run.log.info("checkpoint_saved", path=str(path))
        return path
