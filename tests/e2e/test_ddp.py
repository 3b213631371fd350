"""Data parallel under torchrun (gloo on CPU): two ranks with half the batch each train exactly like one
process with the whole batch, and only rank 0 writes the run directory."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fixtures

pytestmark = pytest.mark.slow

TORCHRUN = Path(sys.executable).with_name("torchrun")
COMMON = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs",
          "loop.max_steps=12", "loop.log_every=4", "optimizer=sgd", "optimizer.lr=0.1", "data.shuffle=true"]


def final_params(run_dir: Path) -> dict:
    index = json.loads((run_dir / "checkpoints" / "index.json").read_text())
    state = torch.load(run_dir / "checkpoints" / index["checkpoints"][-1] / "state.pt", weights_only=True)
    return state["model"]


@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="torchrun not found")
def test_two_ranks_match_one_process_with_the_whole_batch(tmp_path, cli_env):
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else shutil.which("torchrun")
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp = subprocess.run([torchrun, "--nproc_per_node=2", "-m", "csframework", *COMMON, "data.batch_size=8",
                          "backend.strategy=ddp", f"hydra.run.dir={ddp_dir}"],
                         env=cli_env, capture_output=True, text=True, timeout=240)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = subprocess.run([sys.executable, "-m", "csframework", *COMMON, "data.batch_size=16",
                             f"hydra.run.dir={single_dir}"], env=cli_env, capture_output=True, text=True,
                            timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]

    summary = json.loads((ddp_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 12
    # one writer: every event line is there once
    events = (ddp_dir / "events.jsonl").read_text().splitlines()
    assert sum('"event": "fit_start"' in line for line in events) == 1
    # how the run was spread (issue 29 item 7): on the start line and in summary.json; a single process has none
    start = [line for line in ddp.stderr.splitlines() if "fit_start" in line]
    assert len(start) == 1 and "process_group=gloo" in start[0] and "strategy=ddp" in start[0] \
        and "world_size=2" in start[0], ddp.stderr[-3000:]
    assert (summary["world_size"], summary["strategy"], summary["process_group"]) == (2, "ddp", "gloo")
    assert not {"world_size", "strategy", "process_group"} & set(json.loads((single_dir / "summary.json").read_text()))

    a, b = final_params(ddp_dir), final_params(single_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    # evaluation is averaged over both ranks' shards: it matches the single process
    val = json.loads((single_dir / "summary.json").read_text())["metrics"]["val/loss"]
    assert summary["metrics"]["val/loss"] == pytest.approx(val, rel=1e-4)


@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="torchrun not found")
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_and_resume_completes(tmp_path, cli_env):
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else shutil.which("torchrun")
    run_dir = tmp_path / "ddp"
    command = [torchrun, "--nproc_per_node=2", "-m", "csframework", *COMMON, "data.batch_size=8",
               "backend.strategy=ddp", "checkpoint.every_steps=4", "plugins.enable=[durability_plugin:Killer]",
               f"hydra.run.dir={run_dir}"]
    # only rank 1 gets SIGTERM, while step 6 runs; the ranks learn it at the next step boundary (the
    # agreement lags a step, to overlap the compute): both stop after step 7, and rank 0 saves it
    env = dict(cli_env, CSF_TEST_KILL="after_backward@5", CSF_TEST_SIGNAL="TERM", CSF_TEST_KILL_RANK="1")
    stopped = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert stopped.returncode != 0, stopped.stderr[-3000:]
    assert "stopped by SIGTERM after step 7" in stopped.stderr, stopped.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["global_step"] == 7
    index = json.loads((run_dir / "checkpoints" / "index.json").read_text())
    assert index["checkpoints"][-1] == "step-00000007"

    resumed = subprocess.run(command[:-2] + ["checkpoint.resume=auto", f"hydra.run.dir={run_dir}"],
                             env=cli_env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"

    straight_dir = tmp_path / "straight"
    straight = subprocess.run(command[:-2] + [f"hydra.run.dir={straight_dir}"], env=cli_env,
                              capture_output=True, text=True, timeout=240)
    assert straight.returncode == 0, straight.stderr[-3000:]
    a, b = final_params(run_dir), final_params(straight_dir)
    for name in a:
        assert torch.equal(a[name], b[name]), name
