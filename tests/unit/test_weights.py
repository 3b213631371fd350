"""``csf.load_checkpoint`` (``csframework.weights``, issue 29 item 8): a run's newest, best or named
checkpoint read back for use outside the framework, into a model the caller builds; a missing one is named,
a damaged or planted one refused through the same checks as resume; a sharded one consolidated. Sharded
checkpoints of a 2-rank FSDP run: tests/e2e/test_fsdp.py; a CLI run and the README's recipe:
tests/e2e/test_weights_out.py."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pickle
import re
import shutil
import warnings

import pytest
import torch
from torch import nn

import csframework as csf
from csframework.builtin.checkpoint import write_checkpoint
from csframework.models import Supervised

import fixtures
from hostile import plant


def user_model() -> nn.Module:
    """What the user builds: the model ``model=blobs_mlp`` describes, fresh (other weights than trained)."""
    return Supervised(net=fixtures.mlp(dim=8, hidden=16, classes=4), loss="cross_entropy")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def saved_model(checkpoint) -> dict:
    return torch.load(checkpoint / "state.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step run checkpointing every 2 steps, keeping the newest and the best by ``val/loss`` taken as
    ``max`` (so the best is an early checkpoint, not the newest): step-00000002 and step-00000006."""
    run_dir = tmp_path_factory.mktemp("weights") / "run"
    run, summary = fixtures.fit(run_dir, "loop.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=1",
                                "loop.eval_every=2", "loop.eval_steps=2", "checkpoint.keep_best.monitor=val/loss",
                                "checkpoint.keep_best.mode=max")
    final = {k: v.clone() for k, v in run.model.state_dict().items()}
    return run_dir, final, summary


@pytest.fixture
def copy(trained, tmp_path):
    """A copy of the trained run, to damage."""
    shutil.copytree(trained[0], tmp_path / "run", symlinks=True)
    return tmp_path / "run"


# -- newest, best, named --------------------------------------------------------------------------------------
def test_the_newest_checkpoint_loads_into_a_fresh_model_with_the_runs_final_weights(trained):
    run_dir, final, summary = trained
    ckpt = csf.load_checkpoint(run_dir)
    model = user_model()
    assert not same(model.state_dict(), final)
    model.load_state_dict(ckpt.model)  # strict: the keys of the model model._target_ builds, no prefix
    assert same(model.state_dict(), final)
    assert ckpt.path == run_dir / "checkpoints" / "step-00000006" and ckpt.step == 6 and ckpt.stage == "main"
    assert ckpt.metrics["val/loss"] == summary["metrics"]["val/loss"]
    assert ckpt.config["loop"]["max_steps"] == 6
    assert ckpt.config["model"]["net"]["_target_"] == "fixtures.mlp"  # what built the model, as plain data
    with pytest.raises(dataclasses.FrozenInstanceError):
        ckpt.step = 7  # type: ignore[misc]


def test_the_best_checkpoint_is_the_one_keep_best_kept(trained):
    run_dir, final, summary = trained
    best = summary["best_checkpoint"]
    assert best["path"] == "checkpoints/step-00000002"  # the fixture's premise: the best is not the newest
    ckpt = csf.load_checkpoint(run_dir, which="best")
    assert ckpt.path == run_dir / best["path"] and ckpt.step == 2 and ckpt.metrics["val/loss"] == best["value"]
    assert same(ckpt.model, saved_model(ckpt.path)) and not same(ckpt.model, final)
    user_model().load_state_dict(ckpt.model)


def test_a_checkpoint_named_by_its_step_or_given_as_a_directory(trained):
    run_dir, _, _ = trained
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    for ckpt in (csf.load_checkpoint(run_dir, which="step-2"), csf.load_checkpoint(run_dir, which="step-00000002"),
                 csf.load_checkpoint(str(checkpoint)), csf.load_checkpoint(checkpoint, which="step-2")):
        assert ckpt.path == checkpoint and ckpt.step == 2 and same(ckpt.model, saved_model(checkpoint))
    assert csf.load_checkpoint(run_dir / "checkpoints").path == run_dir / "checkpoints" / "step-00000006"


# -- nothing there ----------------------------------------------------------------------------------------------
def test_a_checkpoint_that_is_not_there_is_named_with_what_the_run_holds(trained, copy, tmp_path):
    run_dir, _, _ = trained
    held = "it holds 2 checkpoint(s): step-00000002, step-00000006"
    with pytest.raises(csf.CheckpointNotFound, match=re.escape(
            f"{run_dir / 'checkpoints' / 'step-00000004'}: no such checkpoint; {held}")):
        csf.load_checkpoint(run_dir, which="step-4")  # pruned by keep_last
    with pytest.raises(csf.CheckpointNotFound, match=re.escape(f"{tmp_path / 'nowhere'} does not exist")):
        csf.load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(csf.CheckpointNotFound, match="is not a csframework checkpoint: it holds no meta.json"):
        csf.load_checkpoint(tmp_path / "empty")
    (tmp_path / "weights.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(csf.CheckpointNotFound, match="weights.pt is not a csframework checkpoint: it is a file"):
        csf.load_checkpoint(tmp_path / "weights.pt")
    index = copy / "checkpoints" / "index.json"
    index.write_text(json.dumps({"checkpoints": json.loads(index.read_text())["checkpoints"]}))  # no best kept
    with pytest.raises(csf.CheckpointNotFound, match=r"no best checkpoint was kept \(train with "
                                                     r"checkpoint.keep_best.monitor=<metric> to keep one\)") as e:
        csf.load_checkpoint(copy, which="best")
    assert e.value.exit_code == 2 and isinstance(e.value, FileNotFoundError)


def test_which_is_newest_best_or_a_step(trained):
    run_dir, _, _ = trained
    with pytest.raises(ValueError, match=r"which='last': give 'newest', 'best' or 'step-<N>'"):
        csf.load_checkpoint(run_dir, which="last")
    with pytest.raises(ValueError, match=r"which='best' picks among a run's checkpoints, and .*step-00000006 is one"):
        csf.load_checkpoint(run_dir / "checkpoints" / "step-00000006", which="best")


@pytest.mark.parametrize("which", [6, None, b"newest", "step-" + "9" * 5000, 1.5])
def test_which_of_another_type_or_size_is_the_documented_value_error(trained, which):
    """Before (issue 37): an int, None or bytes were a TypeError, a 5000-digit step an int conversion error."""
    with pytest.raises(ValueError, match=r"load_checkpoint: which=.*: give 'newest', 'best' or 'step-<N>'"):
        csf.load_checkpoint(trained[0], which=which)


def test_an_error_repeats_no_input_of_unbounded_size(trained, tmp_path):
    """Issue 47 (14): a 5000-digit step, or a path of 20000 characters: the error shows the input's start and
    end and its length, not all of it (before: over 2000 characters of the argument repeated)."""
    run_dir = trained[0]
    step = run_dir / "checkpoints" / "step-00000006"
    huge = "step-" + "9" * 5000
    for path, which in [(run_dir, huge), (step, huge), (tmp_path / ("x" * 20000), "newest")]:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            csf.load_checkpoint(path, which=which)
        message = str(e.value)
        assert len(message) < 700 and " characters)" in message, message[:700]


def test_a_run_directorys_checkpoints_that_is_a_link_is_refused_as_resume_refuses_it(copy, trained, tmp_path):
    """Before (issue 37): the link was followed and another run's weights returned as this run's."""
    other = tmp_path / "other"
    shutil.copytree(trained[0], other)
    shutil.rmtree(copy / "checkpoints")
    (copy / "checkpoints").symlink_to(other / "checkpoints", target_is_directory=True)
    with pytest.raises(csf.CsfError, match=re.escape(f"{copy / 'checkpoints'}: it is a symbolic link")):
        csf.load_checkpoint(copy)


# -- damaged, planted ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage, says", [
    ("truncate", r"state.pt has \d+ bytes, \d+ were written \(truncated or damaged\)"),
    ("flip", "state.pt fails its checksum in record"),
    ("no-meta", "meta.json is missing or unreadable"),
    ("no-state", "state.pt is missing"),
])
def test_a_damaged_checkpoint_is_an_error_naming_the_file_never_older_weights(copy, damage, says):
    newest = copy / "checkpoints" / "step-00000006"
    state = newest / "state.pt"
    if damage == "truncate":
        state.write_bytes(state.read_bytes()[:1000])
    elif damage == "flip":
        data = bytearray(state.read_bytes())
        data[len(data) * 3 // 4] ^= 0x01  # one bit inside tensor data: same size, the zip still valid
        state.write_bytes(bytes(data))
    elif damage == "no-meta":
        (newest / "meta.json").unlink()
    else:
        state.unlink()
    with pytest.raises(csf.DamagedCheckpoint, match=re.escape(f"checkpoint {newest}: ") + says
                       + r".*; the run's other checkpoints: step-00000002 \(load one with which='step-<N>'\)"):
        csf.load_checkpoint(copy)
    assert csf.load_checkpoint(copy, which="step-2").step == 2


@pytest.mark.parametrize("name", ["state.pt", "meta.json", "config.yaml"])
def test_a_checkpoint_file_that_is_a_link_is_refused_not_followed(copy, tmp_path, name):
    """The link points at the same file of the run's other, good checkpoint: followed, it would load."""
    newest = copy / "checkpoints" / "step-00000006"
    other = copy / "checkpoints" / "step-00000002" / name
    before = other.read_bytes()
    planted = plant(newest / name, "symlink-file", tmp_path / "victim", target=other)
    with pytest.raises(csf.DamagedCheckpoint, match=re.escape(f"checkpoint {newest}: {name}")
                       + r".*symbolic link, which csframework never writes"):
        csf.load_checkpoint(copy)
    assert planted.is_symlink() and other.read_bytes() == before


def test_a_checkpoint_directory_that_links_elsewhere_is_no_checkpoint(copy, trained, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(trained[0] / "checkpoints" / "step-00000006", elsewhere)
    (copy / "checkpoints" / "step-00000008").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(csf.CheckpointNotFound, match="step-00000008: no such checkpoint"):
        csf.load_checkpoint(copy, which="step-8")
    assert csf.load_checkpoint(copy).path.name == "step-00000006"


def test_a_checkpoint_crafted_to_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    # written by the real writer: sizes and checksums hold, so it is the loader that must refuse it
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    write_checkpoint(root, "step-00000003", {"model": Exploit()}, {"global_step": 3}, "")
    with pytest.raises(csf.DamagedCheckpoint, match=re.escape(f"checkpoint {root / 'step-00000003'}: refused to "
                                                              "load state.pt")):
        csf.load_checkpoint(tmp_path / "run")
    assert not marker.exists()


# -- sharded (FSDP) checkpoints, written here by one process; by two ranks: tests/e2e/test_fsdp.py --------------
def sharded_checkpoint(root, model: dict, forge=None):
    """A sharded checkpoint as ``strategy=fsdp`` lays it out (DCP's files in ``sharded/``, ``state.pt`` without
    the model), written by the real writer; ``forge(metadata)`` edits DCP's metadata first (checksums then
    hold: it is the reader that must refuse it)."""
    import torch.distributed.checkpoint as dcp

    from csframework.backends.fsdp import read_metadata
    from csframework.builtin import checkpoint as ckpt

    tmp = ckpt.temporary_dir(root, "step-00000005")
    shards = tmp.sub("sharded").path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"model": model, "optim": {"state": {}, "param_groups": [{"lr": 0.1}]}}
        if "no_dist" in inspect.signature(dcp.save).parameters:
            dcp.save(state, checkpoint_id=str(shards), no_dist=True)
        else:  # torch < 2.5 (the Cerebras venv's 2.4): the older spelling
            dcp.save_state_dict(state, dcp.FileSystemWriter(str(shards)), no_dist=True)
    if forge is not None:
        metadata = read_metadata(shards / ".metadata")
        forge(metadata)
        (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    write_checkpoint(root, "step-00000005", {"sharded": True, "loop": {"global_step": 5}}, {},
                     "seed: 0\n", sharded=tmp)
    return root / "step-00000005"


def test_a_sharded_checkpoint_is_consolidated_into_the_plain_model_without_a_process_group(tmp_path):
    trained = user_model()
    path = sharded_checkpoint(tmp_path / "checkpoints", trained.state_dict())
    ckpt = csf.load_checkpoint(tmp_path)
    assert ckpt.path == path and ckpt.step == 5 and not torch.distributed.is_initialized()
    model = user_model()
    model.load_state_dict(ckpt.model)
    assert same(model.state_dict(), trained.state_dict())


def test_sharded_metadata_claiming_more_than_its_shards_hold_is_refused_before_allocating(tmp_path):
    def huge(metadata):  # a terabyte of float32 in a checkpoint of a few kilobytes
        metadata.state_dict_metadata["model.net.0.weight"].size = torch.Size([1 << 19, 1 << 19])

    path = sharded_checkpoint(tmp_path / "checkpoints", user_model().state_dict(), forge=huge)
    with pytest.raises(csf.DamagedCheckpoint, match=re.escape(f"checkpoint {path}: refused to load sharded/ "
                                                              "(ValueError: its metadata describes")):
        csf.load_checkpoint(tmp_path)


def test_sharded_metadata_whose_negative_size_cancels_a_huge_one_is_refused_before_allocating(tmp_path):
    """Before (issue 37): a tensor of -1 GiB cancelled one of 1 GiB in the size bound, and 1 GiB was allocated
    for shards of kilobytes before the refusal."""
    def cancelling(metadata):
        weights = [k for k in metadata.state_dict_metadata if k.startswith("model.") and k.endswith("weight")]
        metadata.state_dict_metadata[weights[0]].size = torch.Size([1 << 17, 1 << 11])
        metadata.state_dict_metadata[weights[1]].size = torch.Size([-(1 << 17), 1 << 11])

    path = sharded_checkpoint(tmp_path / "checkpoints", user_model().state_dict(), forge=cancelling)
    with pytest.raises(csf.DamagedCheckpoint, match=re.escape(f"checkpoint {path}: refused to load sharded/ "
                                                              "(ValueError: its metadata gives 'model.net.")
                       + r".*the size \[-131072, 2048\], which no tensor has"):
        csf.load_checkpoint(tmp_path)


def test_a_sharded_directory_that_is_a_link_is_not_read_through(tmp_path):
    """Before (issue 37): the shards were read through the link (another checkpoint's, anywhere)."""
    path = sharded_checkpoint(tmp_path / "checkpoints", user_model().state_dict())
    elsewhere = tmp_path / "elsewhere"
    (path / "sharded").rename(elsewhere)
    (path / "sharded").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(csf.DamagedCheckpoint, match=re.escape(f"checkpoint {path}: sharded/ is not a real directory")):
        csf.load_checkpoint(tmp_path)


# -- a model wrapped when it was saved ---------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.", ""])
def test_wrapper_prefixes_are_removed_so_the_weights_load_into_the_plain_model(tmp_path, prefix):
    """DDP (``module.``) and ``torch.compile`` (``_orig_mod.``) prefix every key of a wrapped model."""
    plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    saved = {prefix + k: v for k, v in plain.state_dict().items()}
    root = tmp_path / "checkpoints"
    root.mkdir()
    write_checkpoint(root, "step-00000001", {"model": saved, "loop": {"global_step": 1}}, {}, "seed: 0\n")
    ckpt = csf.load_checkpoint(tmp_path)
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fresh.load_state_dict(ckpt.model)
    assert same(fresh.state_dict(), plain.state_dict()) and ckpt.config == {"seed": 0}


def test_a_model_whose_own_keys_share_a_prefix_only_in_part_is_left_as_it_is(tmp_path):
    model = {"module.weight": torch.ones(1), "bias": torch.zeros(1)}
    root = tmp_path / "checkpoints"
    root.mkdir()
    write_checkpoint(root, "step-00000001", {"model": model, "loop": {"global_step": 1}}, {}, "")
    assert csf.load_checkpoint(tmp_path).model.keys() == model.keys()
