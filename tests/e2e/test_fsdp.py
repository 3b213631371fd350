"""``backend.strategy=fsdp`` (issue 13 item 2): FSDP2 training that matches DDP, sharded checkpoints written
by every rank with torch.distributed.checkpoint, resumed after SIGKILL and with another number of ranks
(read through the restricted reader; its refusals: unit/test_backends_fsdp.py)."""
from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch

import csframework as csf
import fixtures
from csframework.backends.fsdp import FSDP2_TORCH, _SafePlanner, _SafeReader
from csframework.builtin import checkpoint as ckpt
from torchrun import TORCHRUN, assert_same_params, torchrun

COMMON = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "loop.max_steps=20", "loop.log_every=4",
          "optimizer=adamw", "optimizer.lr=0.01", "data.batch_size=8", "checkpoint.every_steps=5",
          "checkpoint.keep_last=4", "backend.timeout_s=30"]
FSDP = ["backend.strategy=fsdp", "backend.fsdp_wrap=[Linear]"]


def sharded_params(checkpoint) -> dict:
    """The full model parameters of a sharded checkpoint, read in this process through the safe reader."""
    state, meta = ckpt.read_checkpoint(checkpoint)
    assert state["sharded"] and state["model"] is None and state["optimizer"] is None
    model = csf.Run(fixtures.compose()).model
    wanted = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    files = {n.split("/", 1)[1] for n in meta["files"] if n.startswith("sharded/")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        torch.distributed.checkpoint.load(wanted, storage_reader=_SafeReader(checkpoint / "sharded", files),
                                          planner=_SafePlanner())
    return wanted["model"]


def newest(run_dir):
    index = json.loads((run_dir / "checkpoints" / "index.json").read_text())
    return run_dir / "checkpoints" / index["checkpoints"][-1]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """An uninterrupted 2-rank fsdp run of 20 steps (checkpoints every 5)."""
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath())
    run_dir = tmp_path_factory.mktemp("fsdp")
    done = torchrun(["--nproc_per_node=2"], [*COMMON, *FSDP, f"hydra.run.dir={run_dir}"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


needs_torchrun = pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not found")
pytestmark = pytest.mark.requires_torch(FSDP2_TORCH, "FSDP2 (backend.strategy=fsdp)")


@pytest.mark.slow
@needs_torchrun
def test_fsdp_trains_like_ddp_and_every_rank_writes_its_shards(tmp_path, cli_env, fsdp_run):
    ddp_dir = tmp_path / "ddp"
    done = torchrun(["--nproc_per_node=2"], [*COMMON, "backend.strategy=ddp", f"hydra.run.dir={ddp_dir}"], cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = torch.load(newest(ddp_dir) / "state.pt", weights_only=True)["model"]
    csf.Run(fixtures.compose()).model.load_state_dict(csf.load_checkpoint(ddp_dir).model)  # DDP-wrapped: plain keys
    assert newest(fsdp_run).name == "step-00000020"
    assert sorted(p.name for p in (newest(fsdp_run) / "sharded").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert_same_params(sharded_params(newest(fsdp_run)), ddp, exact=False)
    summary = json.loads((fsdp_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 20
    assert (summary["world_size"], summary["strategy"], summary["process_group"]) == (2, "fsdp", "gloo")


@pytest.mark.slow
@needs_torchrun
def test_a_compiled_fsdp_run_trains_like_the_eager_one(tmp_path, cli_env, fsdp_run):
    # under fsdp the forward (and its backward) and evaluation are compiled; the update stays eager (DTensors)
    run_dir = tmp_path / "compiled"
    done = torchrun(["--nproc_per_node=2"], [*COMMON, *FSDP, "backend.compile=true", f"hydra.run.dir={run_dir}"],
                    cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 20
    assert summary["compile"]["graph"] == "per function" and summary["compile"]["graph_breaks"] == 0
    assert_same_params(sharded_params(newest(run_dir)), sharded_params(newest(fsdp_run)), exact=False)


@pytest.mark.slow
@needs_torchrun
def test_load_checkpoint_consolidates_a_two_rank_checkpoint_into_the_plain_model(fsdp_run):
    """``csf.load_checkpoint`` in this process (no torchrun, no process group): the whole model, plain
    tensors, loading into a freshly built model, equal to what the restricted DCP reader above reads."""
    ckpt = csf.load_checkpoint(fsdp_run)
    assert ckpt.path == newest(fsdp_run) and ckpt.step == 20 and not torch.distributed.is_initialized()
    assert all(type(t) is torch.Tensor for t in ckpt.model.values())  # whole tensors, no DTensor shards
    model = csf.Run(fixtures.compose()).model
    model.load_state_dict(ckpt.model)
    assert_same_params(model.state_dict(), sharded_params(newest(fsdp_run)))
    older = csf.load_checkpoint(fsdp_run, which="step-10")
    assert_same_params(older.model, sharded_params(fsdp_run / "checkpoints" / "step-00000010"))


@pytest.mark.slow
@needs_torchrun
def test_fsdp_killed_then_resumed_ends_like_the_uninterrupted_run(tmp_path, cli_env, fsdp_run):
    run_dir = tmp_path / "run"
    args = [*COMMON, *FSDP, "checkpoint.resume=auto", "plugins.enable=[durability_plugin:Killer]",
            f"hydra.run.dir={run_dir}"]
    killed = torchrun(["--nproc_per_node=2"], args, dict(cli_env, CSF_TEST_KILL="after_backward@12"))
    assert killed.returncode != 0
    assert newest(run_dir).name == "step-00000010"  # complete, and the newest
    resumed = torchrun(["--nproc_per_node=2"], args, cli_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_params(sharded_params(newest(run_dir)), sharded_params(newest(fsdp_run)))


@pytest.mark.slow
@needs_torchrun
def test_a_checkpoint_of_two_ranks_resumes_with_one(tmp_path, cli_env, fsdp_run):
    run_dir = tmp_path / "one"
    done = torchrun(["--nproc_per_node=1"], [*COMMON, *FSDP, "data.batch_size=16",
                                             f"checkpoint.resume={fsdp_run / 'checkpoints' / 'step-00000010'}",
                                             f"hydra.run.dir={run_dir}"], cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stderr
    assert sorted(p.name for p in (newest(run_dir) / "sharded").iterdir()) == [".metadata", "__0_0.distcp"]
    assert_same_params(sharded_params(newest(run_dir)), sharded_params(newest(fsdp_run)), exact=False)


@pytest.mark.slow
@needs_torchrun
def test_fsdp_mixed_precision_keeps_float32_master_weights(tmp_path, cli_env):
    run_dir = tmp_path / "bf16"
    done = torchrun(["--nproc_per_node=2"], [*COMMON, *FSDP, "precision=bfloat16", "loop.max_steps=8",
                                             f"hydra.run.dir={run_dir}"], cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["metrics"]["train/loss"] < math.log(4)  # below chance
    params = sharded_params(newest(run_dir))
    assert all(p.dtype == torch.float32 and bool(torch.isfinite(p).all()) for p in params.values())
