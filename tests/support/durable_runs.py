"""The durability runs' config and comparisons of their final parameters: shared by
tests/e2e/test_durability_kill.py and test_compile_e2e.py."""
from __future__ import annotations

from pathlib import Path

import torch

from csframework.builtin.checkpoint import list_checkpoints, read_checkpoint
from fixtures import CONF


# 256 samples / batch 16 = 16 batches per epoch = 8 steps of 2 micro-batches: epochs end at steps 8 and 16.
ARGS = ["--config-dir", CONF, "model=blobs_mlp", "data=blobs",
           "+model.net.dropout=0.2", "optimizer=adamw", "optimizer.lr=0.02", "optimizer.schedule.name=cosine",
           "optimizer.schedule.warmup_steps=4", "optimizer.schedule.min_lr=0.001", "loop.max_steps=20",
           "loop.grad_accum_steps=2", "loop.log_every=4", "loop.eval_every=5", "loop.eval_steps=2",
           "checkpoint.every_steps=3", "checkpoint.keep_last=2", "checkpoint.resume=auto", "backend.threads=1",
           "plugins.enable=[durability_plugin:Killer]"]


def final_params(run_dir: Path) -> dict:
    state, _ = read_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])
    return state["model"]


def assert_same(expected: dict, got: dict, label: str) -> None:
    assert expected.keys() == got.keys()
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not different, f"{label}: parameters differ from the uninterrupted run: {different}"
