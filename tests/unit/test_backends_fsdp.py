"""``csframework.backends.fsdp``, in process.

Sharded (``strategy=fsdp``) checkpoints are never executable and list only DCP's own files; what fsdp
cannot do here is refused before launch (issue 13 item 2). Training and resuming: e2e/test_fsdp.py."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import csframework as csf
import fixtures
from csframework import compat
from csframework.backends.fsdp import FSDP2_TORCH, read_metadata
from csframework.builtin import checkpoint as ckpt
from csframework.errors import ValidationError


class Boom:
    """Unpickling this runs ``os.system`` (what a malicious ``.metadata`` would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_malicious_dcp_metadata_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    root, name = tmp_path / "checkpoints", "step-00000004"
    tmp = ckpt.temporary_dir(root, name)
    shards = tmp.sub("sharded").path
    (shards / ".metadata").write_bytes(pickle.dumps(Boom(marker)))
    (shards / "__0_0.distcp").write_bytes(b"\0" * 16)
    state = {"sharded": True, "loop": {"global_step": 4}}
    ckpt.write_checkpoint(root, name, state, {"global_step": 4}, "{}\n", sharded=tmp)
    with pytest.raises(ckpt.DamagedCheckpoint, match=r"refused to load sharded/.metadata \(os.system|posix.system"):
        ckpt.read_checkpoint(root / name, read_metadata)  # the sharded backend's check (read_shard_metadata)
    with pytest.raises(pickle.UnpicklingError):
        read_metadata(root / name / "sharded" / ".metadata")
    assert not marker.exists()


def test_a_sharded_checkpoint_listing_a_foreign_file_is_refused(tmp_path):
    root, name = tmp_path / "checkpoints", "step-00000004"
    tmp = ckpt.temporary_dir(root, name)
    (tmp.sub("sharded").path / ".metadata").write_bytes(b"")
    ckpt.write_checkpoint(root, name, {"sharded": True}, {}, "{}\n", sharded=tmp)
    meta = json.loads((root / name / "meta.json").read_text())
    meta["files"]["sharded/../../evil"] = {"bytes": 0, "crc32": "00000000"}
    (root / name / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.DamagedCheckpoint, match="lists other files"):
        ckpt.read_checkpoint(root / name)


@pytest.mark.parametrize("overrides, problem", [
    pytest.param(["backend.strategy=fsdp", "precision=float16"],
                 "precision: backend.strategy=fsdp computes in FSDP's mixed",
                 marks=pytest.mark.requires_torch(FSDP2_TORCH, "FSDP2 (backend.strategy=fsdp)")),
    (["backend.fsdp_wrap=[Linear]"], "backend.fsdp_wrap: it applies to backend.strategy=fsdp only"),
    (["device=csx", "backend.strategy=fsdp"], "backend.strategy: only CPU/GPU understands it"),
    (["+stages.a.loop.max_steps=2", "+stages.b.backend.strategy=fsdp"],
     "stages.b.backend.strategy: fsdp differs from the run's single; sharded (fsdp) and unsharded stages"),
])
def test_what_fsdp_cannot_do_here_is_refused_before_launch(overrides, problem):
    with pytest.raises(ValidationError) as info:
        csf.Run(fixtures.compose(*overrides))
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


def test_fsdp_on_a_torch_before_2_6_is_refused_before_launch_naming_the_version(monkeypatch):
    """The Cerebras stack pins torch 2.4, which has no FSDP2: one line, before anything is built (on a newer
    torch the version check is made to see 2.4)."""
    monkeypatch.setattr(compat, "TORCH", (2, 4))
    with pytest.raises(ValidationError) as info:
        csf.Run(fixtures.compose("backend.strategy=fsdp", "precision=float16"))
    assert info.value.problems == [
        f"backend.strategy=fsdp (FSDP2 fully_shard) needs torch>=2.6, and this is torch {torch.__version__}; "
        "upgrade torch, or do without it (backend.strategy=ddp)"]


