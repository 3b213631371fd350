"""Beyond one process (issue 13): the output collector across ranks, no hang when a rank dies or stops,
elastic restarts, two "nodes" on localhost. Every run is tiny (the Blobs MLP, 2 ranks, gloo on CPU)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import csframework as csf
from csframework.builtin.checkpoint import read_checkpoint
import fixtures
from torchrun import TORCHRUN, assert_same_params, torchrun

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                                 reason="torchrun not found")]

COMMON = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "loop.max_steps=12", "loop.log_every=4",
          "optimizer=sgd", "optimizer.lr=0.1", "data.shuffle=true", "data.batch_size=8", "backend.strategy=ddp",
          "backend.timeout_s=10", "checkpoint.every_steps=2"]
#: A validation set whose size (61) is not a multiple of 2 ranks x 5 samples per batch.
COLLECT = ["data.val.n=61", "data.eval_batch_size=5", "loop.collect=[preds,labels,logits]", "loop.collect_save=true"]


def final_params(run_dir: Path) -> dict:
    index = json.loads((run_dir / "checkpoints" / "index.json").read_text())
    return torch.load(run_dir / "checkpoints" / index["checkpoints"][-1] / "state.pt", weights_only=True)["model"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collected_outputs_across_two_ranks_equal_one_process_with_and_without_spilling(tmp_path, cli_env):
    single = tmp_path / "single"
    csf.Run(fixtures.compose(*COLLECT), output_dir=single).fit()
    expected = load_file(single / "eval_outputs" / "step_8.safetensors")
    # exactly the validation set, in dataset order: the labels are the dataset's own
    assert torch.equal(expected["labels"], fixtures.Blobs(61, seed=1).y)
    assert expected["logits"].shape == (61, 4) and expected["preds"].shape == (61,)

    for name, memory in (("memory", "256"), ("spilled", "0.0001")):
        run_dir = tmp_path / name
        done = torchrun(["--nproc_per_node=2"], ["--config-dir", fixtures.CONF, *fixtures.TINY, *COLLECT,
                                                 "backend.strategy=ddp", "data.batch_size=8",
                                                 f"loop.collect_max_memory_mb={memory}",
                                                 f"hydra.run.dir={run_dir}"], cli_env)
        assert done.returncode == 0, done.stderr[-3000:]
        got = load_file(run_dir / "eval_outputs" / "step_8.safetensors")
        assert got.keys() == expected.keys()
        for key in expected:  # 2 ranks x 4 samples per step train like 1 x 8: the same model, the same rows
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        collected = [e for e in events if e["event"] == "eval_outputs_collected"]
        assert [e["rows"] for e in collected] == [61] and collected[0]["spilled"] == (name == "spilled")
        if name == "spilled":  # rank 0 held at most a chunk of rows at once, never the whole set
            assert collected[0]["peak_mb"] * 2**20 < 61 * 4 * 4
        assert not list(run_dir.glob(".collect-*")), "spill files left behind"


@pytest.mark.parametrize("signal", ["KILL", "STOP"])
def test_a_dead_or_stopped_rank_makes_the_other_exit_within_the_timeout(tmp_path, cli_env, signal):
    run_dir = tmp_path / "run"
    env = dict(cli_env, CSF_TEST_KILL="batch_start@5", CSF_TEST_SIGNAL=signal, CSF_TEST_KILL_RANK="1")
    # rank 1 dies (or stops) before step 6; torchrun's own grace period for the survivors is 30 s; the run's timeout is 10 s; start-up ~60 s
    done = torchrun(["--nproc_per_node=2"], [*COMMON, "plugins.enable=[durability_plugin:Killer]",
                                             f"hydra.run.dir={run_dir}"], env, timeout=180)
    assert done.returncode != 0
    if signal == "STOP":  # nothing tells rank 0 but the collective's timeout, and it says so in one line
        assert "rank 0: another rank died or stopped answering within backend.timeout_s=10" in done.stderr, \
            done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] in ("failed", "interrupted") and summary["global_step"] < 12
    # the last good checkpoint is complete: it passes the checkpoint plugin's own checks
    index = json.loads((run_dir / "checkpoints" / "index.json").read_text())
    assert index["checkpoints"][-1] == "step-00000004"
    state, _ = read_checkpoint(run_dir / "checkpoints" / "step-00000004")
    assert state["loop"]["global_step"] == 4


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 2-rank run of ``COMMON`` (the reference of the elastic and multi-node tests)."""
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath())
    run_dir = tmp_path_factory.mktemp("straight")
    done = torchrun(["--nproc_per_node=2"], [*COMMON, f"hydra.run.dir={run_dir}"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    return final_params(run_dir)


def test_elastic_restart_after_a_killed_worker_resumes_to_the_uninterrupted_result(tmp_path, cli_env, straight):
    run_dir = tmp_path / "run"
    # rank 1 is SIGKILLed before step 6, in the first attempt only
    env = dict(cli_env, CSF_TEST_KILL="batch_start@5", CSF_TEST_KILL_RANK="1", CSF_TEST_KILL_ATTEMPT="0")
    done = torchrun(["--nproc_per_node=2", "--max-restarts=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{free_port()}"],
                    [*COMMON, "checkpoint.resume=auto", "plugins.enable=[durability_plugin:Killer]",
                     f"hydra.run.dir={run_dir}"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # restarted once, from the newest checkpoint
    assert sum(e["event"] == "fit_start" for e in events) == 2
    assert [e["step"] for e in events if e["event"] == "resumed"] == [4]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert_same_params(final_params(run_dir), straight)


def test_two_nodes_on_localhost_train_like_one_and_only_global_rank_0_writes(tmp_path, cli_env, straight):
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]  # as if the nodes shared no filesystem
    port = free_port()
    nodes = [subprocess.Popen([TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes", "-m", "csframework",
                               *COMMON, f"hydra.run.dir={node_dir}"], env=cli_env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node_dir in node_dirs]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    # whichever node got global rank 0 wrote everything, the other nothing (at most Hydra's own .hydra/)
    writer = next(d for d in node_dirs if (d / "summary.json").exists())
    other = next(d for d in node_dirs if d != writer)
    assert not other.exists() or sorted(p.name for p in other.iterdir() if p.name != ".hydra") == []
    events = (writer / "events.jsonl").read_text().splitlines()
    assert sum('"event": "fit_start"' in line for line in events) == 1
    rows = (writer / "metrics.csv").read_text().splitlines()
    assert len(rows) == len(set(rows))  # every step's metrics written once
    assert json.loads((writer / "summary.json").read_text())["global_step"] == 12
    assert_same_params(final_params(writer), straight)
