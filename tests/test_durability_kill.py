"""Exact resume: a run killed anywhere (SIGKILL), or stopped by SIGTERM/SIGINT, and started again with the
same command and run directory ends with parameters bit-identical to an uninterrupted run.

The run shuffles, uses dropout, a warm-up + cosine schedule, AdamW and gradient accumulation, evaluates and
checkpoints every few steps; kills are sent deterministically by ``durability_plugin.Killer``. The
uninterrupted references run as ``python -m csframework`` subprocesses; the many killed and resumed runs
run the same command line through ``forkrun`` (a fresh forked process each, without the interpreter's
start-up time).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from csframework.builtin.checkpoint import list_checkpoints, read_checkpoint
from fixtures import CONF
from forkrun import run_chains

pytestmark = pytest.mark.slow

# 256 samples / batch 16 = 16 batches per epoch = 8 steps of 2 micro-batches: epochs end at steps 8 and 16.
ARGS = ["--config-dir", CONF, "model=blobs_mlp", "data=blobs",
           "+model.net.dropout=0.2", "optimizer=adamw", "optimizer.lr=0.02", "optimizer.schedule.name=cosine",
           "optimizer.schedule.warmup_steps=4", "optimizer.schedule.min_lr=0.001", "loop.max_steps=20",
           "loop.grad_accum_steps=2", "loop.log_every=4", "loop.eval_every=5", "loop.eval_steps=2",
           "checkpoint.every_steps=3", "checkpoint.keep_last=2", "checkpoint.resume=auto", "backend.threads=1",
           "plugins.enable=[durability_plugin:Killer]"]
COMMAND = [sys.executable, "-m", "csframework", *ARGS]
WORKERS = ["data.num_workers=1", "data.train._target_=durability_plugin.NoisyBlobs"]

KILL_POINTS = [
    "batch_start@0",            # before the first step: nothing to resume, starts over
    "after_backward@4",         # mid gradient accumulation, mid-epoch
    "before_optimizer_step@7",  # last step of epoch 0, gradients complete, not applied
    "batch_end@9",              # step 9 done, its checkpoint not yet written
    "checkpoint_save@12",       # inside on_checkpoint_save of the step-12 checkpoint
    "state_write@15",           # half of state.pt on disk
    "before_commit@6",          # temporary checkpoint complete, not renamed
    "before_index@18",          # checkpoint renamed into place, index not updated
    "epoch_end@16",             # end of epoch 1
    "eval@10",                  # during the evaluation at step 10
    "log@8",                    # while logging metrics
    "train_end@20",             # after the last step, before the final checkpoint
]
WORKER_KILL_POINTS = ["after_backward@10", "state_write@15"]


def _env(cli_env, **extra):
    env = dict(cli_env)
    env.update(extra)
    return env


def _run(run_dir: Path, env: dict, extra=()) -> subprocess.CompletedProcess:
    return subprocess.run(COMMAND + list(extra) + [f"hydra.run.dir={run_dir}"], env=env, capture_output=True,
                          text=True, timeout=240)


def final_params(run_dir: Path) -> dict:
    state, _ = read_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])
    return state["model"]


def assert_same(expected: dict, got: dict, label: str) -> None:
    assert expected.keys() == got.keys()
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not different, f"{label}: parameters differ from the uninterrupted run: {different}"


def job(run_dir: Path, extra=(), **env) -> dict:
    return {"argv": ARGS + list(extra) + [f"hydra.run.dir={run_dir}"], "env": env}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs (without and with a data-loader worker and random augmentation)."""
    tmp = tmp_path_factory.mktemp("reference")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("HYDRA_FULL_ERROR", None)
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(_run, tmp / "plain", env)
        workers = pool.submit(_run, tmp / "workers", env, WORKERS)
        for result in (plain.result(), workers.result()):
            assert result.returncode == 0, result.stderr[-3000:]
    return {"plain": final_params(tmp / "plain"), "workers": final_params(tmp / "workers"), "dir": tmp}


def test_sigkill_anywhere_then_resume_is_bit_identical(reference, tmp_path, cli_env):
    jobs = [(p, ()) for p in KILL_POINTS] + [(p, tuple(WORKERS)) for p in WORKER_KILL_POINTS]
    dirs = [tmp_path / (("w-" if extra else "p-") + point.replace("@", "-")) for point, extra in jobs]
    chains = [[job(d, extra, CSF_TEST_KILL=point), job(d, extra)] for d, (point, extra) in zip(dirs, jobs)]
    results = run_chains(chains, cli_env)
    for (point, extra), run_dir, (killed, resumed) in zip(jobs, dirs, results):
        assert killed["returncode"] == -signal.SIGKILL, f"{point}: not killed\n{killed['stderr'][-2000:]}"
        assert resumed["returncode"] == 0, f"{point}: resume failed\n{resumed['stderr'][-3000:]}"
        assert_same(reference["workers" if extra else "plain"], final_params(run_dir), point)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["global_step"] == 20
        assert not list((run_dir / "checkpoints").glob(".tmp-*")), f"{point}: a temporary directory was left"
        events = (run_dir / "events.jsonl").read_text()
        if point != "batch_start@0":  # every other kill came after a checkpoint: the restart resumed
            assert '"event": "resumed"' in events, point


def test_the_worker_reference_differs_from_the_plain_one(reference):
    """The augmentation in the workers matters: resuming it exactly is a real test."""
    assert any(not torch.equal(reference["plain"][k], reference["workers"][k]) for k in reference["plain"])


def test_signals_finish_the_step_save_and_resume_completes_identically(reference, tmp_path, cli_env):
    term, intr, double = tmp_path / "term", tmp_path / "int", tmp_path / "double"
    stops = run_chains([
        # the signal arrives during the first micro-batch of step 5 (mid-epoch, mid-accumulation)
        [job(term, CSF_TEST_KILL="after_backward@4", CSF_TEST_SIGNAL="TERM")],
        [job(intr, CSF_TEST_KILL="after_backward@4", CSF_TEST_SIGNAL="INT")],
        # a first SIGTERM at step 8, the second while the stop's checkpoint is being saved
        [job(double, CSF_TEST_KILL="batch_start@7", CSF_TEST_SIGNAL="TERM", CSF_TEST_SECOND_AT="checkpoint_save@8")],
    ], cli_env)
    for run_dir, name, (stopped,) in zip((term, intr), ("TERM", "INT"), stops):
        assert stopped["returncode"] == {"TERM": 143, "INT": 130}[name], stopped["stderr"][-2000:]
        assert f"stopped by SIG{name} after step 5" in stopped["stderr"]
        assert "Traceback" not in stopped["stderr"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["global_step"] == 5
        newest = list_checkpoints(run_dir / "checkpoints")[-1]
        assert newest.name == "step-00000005"
        state, meta = read_checkpoint(newest)
        assert state["loop"]["global_step"] == 5 and state["loop"]["micro_step"] == 10
        assert meta["plugins"]["killer"] == {"saved_at": 5}

    (stopped,) = stops[2]
    assert stopped["returncode"] == 143, stopped["stderr"][-2000:]
    assert "SIGTERM again: exiting now" in stopped["stderr"]
    assert [p.name for p in list_checkpoints(double / "checkpoints")] == ["step-00000003", "step-00000006"]
    read_checkpoint(double / "checkpoints" / "step-00000006")  # intact

    resumes = run_chains([[job(term)], [job(intr)], [job(double)]], cli_env)
    for run_dir, (resumed,) in zip((term, intr, double), resumes):
        assert resumed["returncode"] == 0, resumed["stderr"][-3000:]
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
        assert_same(reference["plain"], final_params(run_dir), run_dir.name)


def test_sigterm_through_the_real_cli(reference, tmp_path, cli_env):
    """The same stop with ``python -m csframework`` as a plain subprocess."""
    run_dir = tmp_path / "run"
    stopped = _run(run_dir, _env(cli_env, CSF_TEST_KILL="batch_end@11", CSF_TEST_SIGNAL="TERM"))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == "step-00000012"
    resumed = _run(run_dir, cli_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same(reference["plain"], final_params(run_dir), "SIGTERM (CLI)")
