"""``csframework.builtin.checkpoint.format``: one checkpoint directory is data (``state.pt`` loadable with
``weights_only=True``, ``config.yaml``, ``meta.json`` with sizes and CRC-32s), written atomically; one crafted
to run code is refused and runs nothing; a same-step checkpoint is replaced whole; a large one is synced in
the background and a sync error is reported."""
from __future__ import annotations

import errno
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

import csframework as csf
from csframework.builtin import checkpoint as ckpt
from csframework.builtin.checkpoint import DamagedCheckpoint, read_checkpoint, write_checkpoint

from fixtures import events, fit


def test_a_checkpoint_is_data_json_and_yaml_with_checksums(tmp_path):
    fit(tmp_path, "loop.max_steps=4", "checkpoint.every_steps=2")
    root = tmp_path / "checkpoints"
    assert json.loads((root / "index.json").read_text()) == {"checkpoints": ["step-00000002", "step-00000004"]}
    newest = root / "step-00000004"
    assert sorted(p.name for p in newest.iterdir()) == ["config.yaml", "meta.json", "state.pt"]
    meta = json.loads((newest / "meta.json").read_text())
    assert set(meta["files"]) == {"state.pt", "config.yaml"}
    assert meta["files"]["state.pt"]["bytes"] == (newest / "state.pt").stat().st_size
    assert "max_steps: 4" in (newest / "config.yaml").read_text()  # the composed config, as YAML
    # every tensor is loadable with weights_only=True: no pickled objects in the file
    state = torch.load(newest / "state.pt", weights_only=True)
    assert state["loop"]["global_step"] == 4 and isinstance(state["rng"]["numpy"], torch.Tensor)
    assert not list(root.glob(".tmp-*"))


def _crafted(path: Path, marker: Path, as_zip: bool) -> None:
    """A checkpoint directory whose state.pt runs ``touch marker`` when unpickled, with matching checksums
    (so it is the loader, not the checksum, that must refuse it)."""

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path.mkdir(parents=True)
    payload = {"model": Exploit(), "version": 1}
    if as_zip:
        torch.save(payload, path / "state.pt")
    else:
        (path / "state.pt").write_bytes(pickle.dumps(payload, protocol=2))
    files = {"state.pt": {"bytes": (path / "state.pt").stat().st_size, "crc32": ckpt.file_crc32(path / "state.pt")},
             "config.yaml": {"bytes": 0, "crc32": "00000000"}}
    (path / "config.yaml").write_text("")
    (path / "meta.json").write_text(json.dumps({"global_step": 3, "files": files, "format": ckpt.FORMAT}))


@pytest.mark.parametrize("as_zip", [True, False], ids=["torch.save", "plain-pickle"])
def test_a_checkpoint_crafted_to_run_code_is_refused_and_runs_nothing(tmp_path, as_zip):
    marker = tmp_path / "pwned"
    crafted = tmp_path / "evil" / "step-00000003"
    _crafted(crafted, marker, as_zip)
    with pytest.raises(DamagedCheckpoint, match="refused to load"):
        read_checkpoint(crafted)
    assert not marker.exists()
    # through a run: an explicit path is refused naming it; auto refuses to start over what it found
    # but could not read (exit 2 naming it: starting from step 0 would prune it at the first saves)
    with pytest.raises(csf.CsfError, match=re.escape(f"checkpoint.resume: checkpoint {crafted}: refused to load")):
        fit(tmp_path / "run", "loop.max_steps=2", f"checkpoint.resume={crafted}")
    assert not marker.exists()
    run_dir = tmp_path / "auto"
    _crafted(run_dir / "checkpoints" / "step-00000003", marker, as_zip)
    with pytest.raises(csf.CsfError, match=r"checkpoint.resume=auto: found 1 checkpoint\(s\) .* could read none "
                                           r"\(step-00000003;.*checkpoint.start_over=true") as refused:
        fit(run_dir, "loop.max_steps=2", "checkpoint.resume=auto")
    assert refused.value.exit_code == 2 and not marker.exists()
    assert any(e["event"] == "checkpoint_damaged" for e in events(run_dir))
    assert (run_dir / "checkpoints" / "step-00000003" / "state.pt").exists()  # left as it was found


def test_a_large_checkpoint_synced_in_the_background_reads_back_and_reports_a_sync_error(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.format, "_SYNC_EVERY", 1 << 16)  # a background fdatasync every 64 KiB
    synced = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(ckpt.format.os, "fdatasync", lambda fd: synced.append(fd) or real_fdatasync(fd))
    state = {"model": {f"w{i}": torch.randn(64, 64) for i in range(20)}}  # 20 records of 16 KiB
    root = tmp_path / "checkpoints"
    write_checkpoint(root, "step-1", state, {"global_step": 1}, "a: 1\n")
    assert synced  # the background thread ran
    loaded, _ = read_checkpoint(root / "step-1")
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())

    def failing(fd):  # the disk reports an I/O error to the background sync only
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ckpt.format.os, "fdatasync", failing)
    with pytest.raises(ckpt.CheckpointWriteError, match="step-2 .Input/output error"):
        write_checkpoint(root, "step-2", state, {"global_step": 2}, "a: 1\n")
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]


def test_write_checkpoint_replaces_a_same_step_checkpoint_whole(tmp_path):
    root = tmp_path / "checkpoints"
    write_checkpoint(root, "step-1", {"model": {"w": torch.zeros(2)}}, {"global_step": 1}, "a: 1\n")
    write_checkpoint(root, "step-1", {"model": {"w": torch.ones(2)}}, {"global_step": 1}, "a: 2\n")
    state, _ = read_checkpoint(root / "step-1")
    assert torch.equal(state["model"]["w"], torch.ones(2))
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
