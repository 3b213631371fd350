"""Exact resume: a run killed anywhere (SIGKILL), or stopped by SIGTERM/SIGINT, and started again with the
same command and run directory ends with parameters bit-identical to an uninterrupted run.

The run shuffles, uses dropout, a warm-up + cosine schedule, AdamW and gradient accumulation, evaluates and
checkpoints every few steps; kills are sent deterministically by ``durability_plugin.Killer``. The runs
use the CLI's command line through ``forkrun`` (a fresh forked process each, without the interpreter's
start-up time); one SIGTERM stop and resume also runs as plain ``python -m csframework`` subprocesses.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from csframework.builtin.checkpoint import list_checkpoints, read_checkpoint
from durable_runs import ARGS, assert_same, final_params
from forkrun import run_chains

pytestmark = pytest.mark.slow

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


def job(run_dir: Path, extra=(), collect=(), **env) -> dict:
    return {"argv": ARGS + list(extra) + [f"hydra.run.dir={run_dir}"], "env": env,
            "collect": [str(run_dir / c) for c in collect]}


KILL_JOBS = [(p, ()) for p in KILL_POINTS] + [(p, tuple(WORKERS)) for p in WORKER_KILL_POINTS]
STOP_COLLECT = ("summary.json", "checkpoints/index.json", "checkpoints/step-00000005/meta.json")
SIGNAL_JOBS = {
    # the signal arrives during the first micro-batch of step 5 (mid-epoch, mid-accumulation)
    "TERM": dict(CSF_TEST_KILL="after_backward@4", CSF_TEST_SIGNAL="TERM"),
    "INT": dict(CSF_TEST_KILL="after_backward@4", CSF_TEST_SIGNAL="INT"),
    # a first SIGTERM at step 8, the second while the stop's checkpoint is being saved
    "double": dict(CSF_TEST_KILL="batch_start@7", CSF_TEST_SIGNAL="TERM", CSF_TEST_SECOND_AT="checkpoint_save@8"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cli_env_module):
    """Every run of this module, through one ``forkrun`` driver, two at a time: the uninterrupted
    references (without and with a data-loader worker and random augmentation), each kill followed by a
    restart, each signal followed by a restart."""
    tmp = tmp_path_factory.mktemp("runs")
    chains, names = [], []
    for name, extra in (("plain", ()), ("workers", tuple(WORKERS))):
        chains.append([job(tmp / "reference" / name, extra)])
        names.append(("reference", name))
    for point, extra in KILL_JOBS:
        run_dir = tmp / "kill" / (("w-" if extra else "p-") + point.replace("@", "-"))
        chains.append([job(run_dir, extra, CSF_TEST_KILL=point), job(run_dir, extra)])
        names.append(("kill", (point, extra)))
    for name, env in SIGNAL_JOBS.items():
        run_dir = tmp / "signal" / name
        chains.append([job(run_dir, collect=STOP_COLLECT, **env), job(run_dir)])
        names.append(("signal", name))
    results = run_chains(chains, cli_env_module)
    out: dict = {"reference": {}, "kill": {}, "signal": {}, "dir": tmp}
    for (kind, key), chain in zip(names, results):
        out[kind][key] = chain
    for name, (result,) in out["reference"].items():
        assert result["returncode"] == 0, result["stderr"][-3000:]
        out["reference"][name] = final_params(tmp / "reference" / name)
    return out


@pytest.fixture(scope="module")
def reference(runs):
    return runs["reference"]


def test_sigkill_anywhere_then_resume_is_bit_identical(runs, reference):
    for (point, extra), (killed, resumed) in runs["kill"].items():
        run_dir = runs["dir"] / "kill" / (("w-" if extra else "p-") + point.replace("@", "-"))
        assert killed["returncode"] == -signal.SIGKILL, f"{point}: not killed\n{killed['stderr'][-2000:]}"
        assert resumed["returncode"] == 0, f"{point}: resume failed\n{resumed['stderr'][-3000:]}"
        assert_same(reference["workers" if extra else "plain"], final_params(run_dir), point)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["global_step"] == 20
        assert not list((run_dir / "checkpoints").glob(".tmp-*")), f"{point}: a temporary directory was left"
        events = (run_dir / "events.jsonl").read_text()
        if point != "batch_start@0":  # every other kill came after a checkpoint: the restart resumed
            assert '"event": "resumed"' in events, point
        # the rows the killed run logged after its checkpoint were moved aside, not doubled (metrics.py)
        reference_dir = runs["dir"] / "reference" / ("workers" if extra else "plain")
        assert rows(run_dir) == rows(reference_dir), point


def rows(run_dir: Path) -> list[str]:
    """metrics.csv's rows, rates (which differ from run to run) left out."""
    return [r for r in (run_dir / "metrics.csv").read_text().splitlines() if ",steps_per_sec," not in r]


def test_the_worker_reference_differs_from_the_plain_one(reference):
    """The augmentation in the workers matters: resuming it exactly is a real test."""
    assert any(not torch.equal(reference["plain"][k], reference["workers"][k]) for k in reference["plain"])


@pytest.mark.parametrize("name", ["TERM", "INT"])
def test_a_signal_finishes_the_step_saves_and_resume_completes_identically(runs, reference, name):
    run_dir = runs["dir"] / "signal" / name
    stopped, resumed = runs["signal"][name]
    assert stopped["returncode"] == {"TERM": 143, "INT": 130}[name], stopped["stderr"][-2000:]
    assert f"SIG{name}: finishing the current step, saving a checkpoint" in stopped["stderr"]
    assert f"stopped by SIG{name} after step 5" in stopped["stderr"]
    assert "Traceback" not in stopped["stderr"]
    files = stopped["files"]
    summary = json.loads(files[str(run_dir / "summary.json")])
    assert summary["status"] == "interrupted" and summary["global_step"] == 5
    index = json.loads(files[str(run_dir / "checkpoints/index.json")])
    assert index["checkpoints"][-1] == "step-00000005"
    meta = json.loads(files[str(run_dir / "checkpoints/step-00000005/meta.json")])
    assert meta["plugins"]["killer"] == {"saved_at": 5}  # the step: the directory's name, the state's position

    assert resumed["returncode"] == 0, resumed["stderr"][-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert_same(reference["plain"], final_params(run_dir), f"SIG{name}")


def test_a_second_signal_exits_at_once_and_nothing_is_corrupted(runs, reference):
    run_dir = runs["dir"] / "signal" / "double"
    stopped, resumed = runs["signal"]["double"]
    assert stopped["returncode"] == 143, stopped["stderr"][-2000:]
    assert "SIGTERM again: exiting now" in stopped["stderr"]
    index = json.loads(stopped["files"][str(run_dir / "checkpoints/index.json")])
    assert index["checkpoints"] == ["step-00000003", "step-00000006"]
    assert resumed["returncode"] == 0, resumed["stderr"][-3000:]
    log = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not any(e["event"] == "checkpoint_damaged" for e in log)
    assert next(e for e in log if e["event"] == "resumed")["path"].endswith("step-00000006")
    assert_same(reference["plain"], final_params(run_dir), "double SIGTERM")


def test_sigterm_through_the_real_cli(reference, tmp_path, cli_env):
    """The same stop with ``python -m csframework`` as a plain subprocess."""
    run_dir = tmp_path / "run"
    stopped = _run(run_dir, _env(cli_env, CSF_TEST_KILL="batch_end@11", CSF_TEST_SIGNAL="TERM"))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert newest.name == "step-00000012"
    state, _ = read_checkpoint(newest)
    assert state["loop"]["global_step"] == 12 and state["loop"]["micro_step"] == 24
    resumed = _run(run_dir, cli_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same(reference["plain"], final_params(run_dir), "SIGTERM (CLI)")
