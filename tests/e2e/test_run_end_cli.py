"""The end of a run and its resume, as a new user meets them on the command line (issue 29, items 2 and 4):
the last step evaluates before its checkpoint, so the checkpoint, ``keep_best`` and ``summary.json`` see
its metrics; a resume says where it goes on from, warns naming each learning-rate schedule or optimizer
setting changed since the checkpoint (the schedule goes on as saved: no jump of the rate), and a run
resumed at its end says so in one line and writes nothing.

Every command line is the user's, on the small MLP (``model=blobs_mlp data=blobs``), run through
``forkrun`` (a forked child per command: the CLI's ``main()`` without the interpreter's start-up).
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

import fixtures
from forkrun import run_chains

pytestmark = pytest.mark.slow

TINY = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "loop.eval_steps=2"]
#: The default optimizer (adamw, cosine with 30 warm-up steps from 3e-3 to min_lr 3e-4), logged every 10 steps.
RUN_40 = ["loop.max_steps=40", "loop.log_every=10"]
CHANGED = ["optimizer.lr=0.01", "optimizer.schedule.warmup_steps=5", "optimizer.schedule.name=linear",
           "optimizer.weight_decay=0.1"]
END_FILES = ("summary.json", "metrics.csv", "checkpoints/index.json", "checkpoints/step-00000080/meta.json")


def job(run_dir: Path, *overrides: str, collect=(), **env) -> dict:
    return {"argv": [*TINY, *overrides, f"hydra.run.dir={run_dir}"], "env": env,
            "collect": [str(run_dir / c) for c in collect]}


def lr_by_step(run_dir: Path) -> dict[int, float]:
    rows = csv.DictReader(io.StringIO((run_dir / "metrics.csv").read_text()))
    return {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "lr"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cli_env_module):
    tmp = tmp_path_factory.mktemp("run_end")
    chains = {
        "best": [job(tmp / "best", "checkpoint.every_steps=20", "loop.max_steps=40", "loop.eval_every=30",
                     "checkpoint.keep_best.monitor=val/loss")],
        "longer": [job(tmp / "longer", *RUN_40),
                   job(tmp / "longer", "loop.max_steps=80", "loop.log_every=10", "checkpoint.resume=auto",
                       collect=END_FILES),
                   job(tmp / "longer", "loop.max_steps=80", "loop.log_every=10", "checkpoint.resume=auto",
                       collect=END_FILES)],
        # stopped by SIGTERM after step 25 (its checkpoint), resumed with other schedule and optimizer settings
        "changed": [job(tmp / "changed", *RUN_40, "checkpoint.resume=auto", "plugins.enable=[durability_plugin:Killer]",
                        CSF_TEST_KILL="batch_end@25", CSF_TEST_SIGNAL="TERM"),
                    job(tmp / "changed", *RUN_40, "checkpoint.resume=auto", *CHANGED)],
    }
    results = run_chains(list(chains.values()), cli_env_module)
    return {"dir": tmp, **dict(zip(chains, results))}


def test_the_last_checkpoint_holds_the_final_evaluation_and_is_the_best(runs):
    (result,) = runs["best"]
    assert result["returncode"] == 0, result["stderr"][-3000:]
    run_dir = runs["dir"] / "best"
    summary = json.loads((run_dir / "summary.json").read_text())
    final = summary["metrics"]["val/loss"]
    meta = json.loads((run_dir / "checkpoints" / "step-00000040" / "meta.json").read_text())
    assert meta["metrics"]["val/loss"] == final, "the step-40 checkpoint holds step 30's evaluation"
    assert summary["best_checkpoint"] == {"path": "checkpoints/step-00000040", "metric": "val/loss", "value": final}
    at_40 = [e["event"] for e in fixtures.events(run_dir)
             if e["step"] == 40 and e["event"] in ("eval", "checkpoint_saved")]
    assert at_40 == ["eval", "checkpoint_saved"]


def test_raising_max_steps_on_resume_says_so_and_keeps_the_saved_schedule(runs):
    first, resumed, _ = runs["longer"]
    run_dir = runs["dir"] / "longer"
    assert first["returncode"] == 0 and resumed["returncode"] == 0, resumed["stderr"][-3000:]
    # where it resumed from
    resumed_line = next(line for line in resumed["stderr"].splitlines() if " - resumed " in line)
    assert f"path={run_dir}/checkpoints/step-00000040" in resumed_line and "step=40" in resumed_line
    # one warning line naming the key, the values and the step, and what it means
    (warning,) = [line for line in resumed["stderr"].splitlines() if "resume_settings_changed" in line]
    assert "[WARNING]" in warning and "loop.max_steps: 40 -> 80" in warning
    assert "resuming at step 40 continues the checkpoint's learning-rate schedule" in warning
    assert "from step 40 to 80 the rate stays at its final 0.0003" in warning
    (event,) = [e for e in fixtures.events(run_dir) if e["event"] == "resume_settings_changed"]
    assert event["changed"] == ["loop.max_steps: 40 -> 80"] and event["step"] == 40 and event["level"] == "warning"
    # the rate does not jump back up (it was 0.002 at step 50): the 40-step schedule's final rate goes on
    lr = lr_by_step(run_dir)
    assert lr[40] == pytest.approx(3e-4)
    assert [lr[s] for s in (50, 60, 70, 80)] == pytest.approx([3e-4] * 4)


def test_resuming_a_complete_run_says_so_in_one_line_and_writes_nothing(runs):
    _, resumed, again = runs["longer"]
    assert again["returncode"] == 0, again["stderr"][-3000:]
    assert again["stdout"].splitlines() == ["csframework: already complete at step 80; nothing to do"]
    assert " - train " not in again["stderr"] and "checkpoint_saved" not in again["stderr"]
    assert "resume_settings_changed" not in again["stderr"]
    for path, text in resumed["files"].items():
        assert text is not None and again["files"][path] == text, f"{Path(path).name} was rewritten"


def test_other_schedule_and_optimizer_settings_changed_on_resume_are_each_named(runs):
    stopped, resumed = runs["changed"]
    run_dir = runs["dir"] / "changed"
    assert stopped["returncode"] == 143, stopped["stderr"][-3000:]
    assert "nothing_to_resume" in stopped["stderr"] and f"path={run_dir}/checkpoints" in stopped["stderr"]
    assert resumed["returncode"] == 0, resumed["stderr"][-3000:]
    (event,) = [e for e in fixtures.events(run_dir) if e["event"] == "resume_settings_changed"]
    step = event["step"]
    assert step in (25, 26)
    assert event["changed"] == ["optimizer.lr: 0.003 -> 0.01", "optimizer.schedule.name: cosine -> linear",
                                "optimizer.schedule.warmup_steps: 30 -> 5", "optimizer.weight_decay: 0.01 -> 0.1"]
    assert f"resuming at step {step} continues" in event["problem"]
    assert ("optimizer.lr, optimizer.schedule.name, optimizer.schedule.warmup_steps, optimizer.weight_decay keep "
            "the checkpoint's values") in event["problem"]
    # the saved schedule goes on: the rates of the uninterrupted 40-step run
    straight = lr_by_step(runs["dir"] / "longer")
    lr = lr_by_step(run_dir)
    assert [lr[s] for s in (30, 40)] == pytest.approx([straight[30], straight[40]])
