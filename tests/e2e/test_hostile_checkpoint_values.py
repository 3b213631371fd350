"""Forged values in a checkpoint (issue 37): a ``state.pt`` rewritten with consistent checksums, holding a value
the config itself would refuse. Resume must call the newest checkpoint damaged, naming it and the value, fall
back to the older one, and train from there: no run ends ``completed`` on a forged loss scale that skips every
step, a step count past the end of its stage, a negative or infinite learning rate, or a stage that is not one.

The completed run (checkpoints at steps 2 and 4, float16 with dynamic loss scaling so the scale is in the
state) is copied for each attack; the attack is on ``step-00000004``; the resumed run asks for 6 steps.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import csframework as csf
import fixtures
from hostile import forge_state

RUN = ["precision=float16", "precision.init_scale=256", "optimizer=adamw", "optimizer.lr=0.01",
       "optimizer.schedule.name=cosine", "checkpoint.every_steps=2", "checkpoint.keep_last=5"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    base = tmp_path_factory.mktemp("forged-template")
    csf.Run(fixtures.compose(*RUN, "loop.max_steps=4"), output_dir=base / "run").fit()
    return base / "run"


def _set(path: str, value):
    """A change setting ``state[a][b]...`` (``path`` dot-separated, ``[i]`` for list items) to ``value``."""
    def change(state):
        keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
        node = state
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return change


def _base_lrs(forge):
    """A change setting the schedule's base rates to ``forge(its rates)``."""
    def change(state):
        state["scheduler"]["base_lrs"] = forge(state["scheduler"]["base_lrs"])
    return change


def _position(**values):
    def change(state):
        state["loop"].update(values)
    return change


ATTACKS = {
    "scale-inf": (_set("backend.precision.scale", math.inf), "backend.precision.scale: inf"),
    "scale-nan": (_set("backend.precision.scale", math.nan), "backend.precision.scale: nan"),
    "scale-negative": (_set("backend.precision.scale", -4.0), "backend.precision.scale: -4.0"),
    "step-huge": (_position(global_step=10**12, stage_step=10**12), "loop.stage_step: 1000000000000"),
    "global-step-huge": (_position(global_step=10**12), "loop.global_step: 1000000000000"),
    "stage-index-negative": (_position(stage_index=-1), "loop.stage_index: -1"),
    "stage-index-string": (_position(stage_index="0"), "loop.stage_index: str"),
    "epoch-huge": (_position(epoch=2**70), "loop.epoch: 1180591620717411303424"),
    "plan-lr-negative": (_set("scheduler.plan.lr", -0.5), "scheduler.plan.lr: -0.5"),
    "plan-lr-inf": (_set("scheduler.plan.lr", math.inf), "scheduler.plan.lr: inf"),
    "plan-total-negative": (_set("scheduler.plan.total_steps", -7), "scheduler.plan.total_steps: -7"),
    "plan-lr-beyond-float32": (_set("scheduler.plan.lr", 1e300), "scheduler.plan.lr: 1e+300"),
    "plan-ratio-above-one": (_set("scheduler.plan.min_lr_ratio", 5.0), "scheduler.plan.min_lr_ratio: 5.0"),
    "base-lrs-strings": (_base_lrs(lambda lrs: ["x"] * len(lrs)), "scheduler.base_lrs[0]: str"),
    "base-lrs-too-many": (_base_lrs(lambda lrs: [*lrs, 0.01]), "scheduler.base_lrs: it must be a list of 2"),
    "group-lr-nan": (_set("optimizer.param_groups[0].lr", math.nan), "optimizer.param_groups[0].lr: nan"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_forged_value_makes_the_checkpoint_damaged_and_resume_falls_back(template, tmp_path, attack):
    change, named = ATTACKS[attack]
    run_dir = tmp_path / "run"
    shutil.copytree(template, run_dir)
    forged = run_dir / "checkpoints" / "step-00000004"
    forge_state(forged, change, meta_step=10**12 if "huge" in attack else None)
    run = csf.Run(fixtures.compose(*RUN, "loop.max_steps=6", "checkpoint.resume=auto"), output_dir=run_dir)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    summary = run.fit()
    damaged = [e for e in fixtures.events(run_dir) if e.get("event") == "checkpoint_damaged"]
    assert [e["path"] for e in damaged] == [str(forged)]
    assert named in damaged[0]["error"] and "values this run's config refuses" in damaged[0]["error"]
    resumed = [e for e in fixtures.events(run_dir) if e.get("event") == "resumed"]
    assert resumed[-1]["path"] == str(run_dir / "checkpoints" / "step-00000002")
    assert summary["status"] == "completed" and summary["global_step"] == 6
    assert not (run_dir / "checkpoints" / "step-1000000000000").exists()
    scale = run.backend.state_dict()["precision"]["scale"]
    assert math.isfinite(scale) and scale > 0
    assert any(not torch.equal(before[k], v) for k, v in run.model.state_dict().items())


def test_an_untouched_checkpoint_still_resumes(template, tmp_path):
    """The rules hold for what csframework writes: the newest checkpoint is the one resumed."""
    run_dir = tmp_path / "run"
    shutil.copytree(template, run_dir)
    summary = csf.Run(fixtures.compose(*RUN, "loop.max_steps=6", "checkpoint.resume=auto"), output_dir=run_dir).fit()
    events = fixtures.events(run_dir)
    assert not [e for e in events if e.get("event") == "checkpoint_damaged"]
    assert [e for e in events if e.get("event") == "resumed"][-1]["path"] == str(run_dir / "checkpoints" / "step-00000004")
    assert summary["global_step"] == 6


def test_a_forged_summary_of_a_complete_run_is_rewritten_from_its_checkpoint(template, tmp_path):
    """Derived, not believed: resuming a complete run keeps its summary.json only if its metrics are the ones
    the checkpoint resumed holds. Before: a forged val/loss 0.0001 survived (the checkpoint says otherwise)."""
    import json

    run_dir = tmp_path / "run"
    shutil.copytree(template, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    truth = dict(summary["metrics"])
    summary["metrics"]["val/loss"] = 0.0001
    (run_dir / "summary.json").write_text(json.dumps(summary))
    run = csf.Run(fixtures.compose(*RUN, "loop.max_steps=4", "checkpoint.resume=auto"), output_dir=run_dir)
    run.fit()
    assert run.already_complete
    rewritten = json.loads((run_dir / "summary.json").read_text())["metrics"]
    # every metric the checkpoint holds; the rate is the fit's, which the checkpoint (saved at its last step,
    # before the fit's rate is known) holds as its last log's: a measured speed, not a result
    rate = rewritten.pop("steps_per_sec")
    assert rewritten == {k: v for k, v in truth.items() if k != "steps_per_sec"}
    assert isinstance(rate, float) and rate > 0
