"""``optimizer.schedule.name=plateau`` (issue 49 item 4): torch's ``ReduceLROnPlateau`` rule stepped at each
evaluation, its state in checkpoints (a resumed run's rates equal the uninterrupted run's); a
``ReduceLROnPlateau`` ``_target_`` refused at ``mode=check``; ``run.scale_lr``, which every schedule
respects and checkpoints keep."""
from __future__ import annotations

import csv
import math

import pytest
import torch

import csframework as csf
from csframework.config import ScheduleConfig
from csframework.plateau import Plateau
import fixtures

PLATEAU = ["optimizer.schedule.name=plateau", "optimizer.lr=0.5"]


def rates(run_dir) -> dict[int, float]:
    """The ``lr`` logged at each step (``loop.log_every=1``): the rate of the step after it."""
    with open(run_dir / "metrics.csv") as f:
        return {int(row["step"]): float(row["value"]) for row in csv.DictReader(f) if row["name"] == "lr"}


@pytest.mark.parametrize("settings", [
    dict(mode="min", factor=0.5, patience=2, threshold=1e-4, threshold_mode="rel", cooldown=0, min_lr=0.0),
    dict(mode="max", factor=0.25, patience=0, threshold=0.1, threshold_mode="abs", cooldown=2, min_lr=0.01),
    dict(mode="min", factor=0.5, patience=1, threshold=0.05, threshold_mode="rel", cooldown=1, min_lr=0.2),
])
def test_the_rule_is_torch_s_reduce_lr_on_plateau(settings):
    values = [5.0, 4.0, 4.0, 3.999, 4.2, 3.0, 3.0, 3.1, float("nan"), 2.0, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0, 3.1]
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    torch_rule = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **settings)
    ours = Plateau(ScheduleConfig(**{**settings, "name": "plateau"}), 1.0)
    for value in values:
        torch_rule.step(value)
        ours.observe(value)
        assert ours.scale == optimizer.param_groups[0]["lr"]


def test_a_plateau_run_resumed_mid_way_has_the_uninterrupted_run_s_rates(tmp_path):
    # val/loss falls, so under mode=max every evaluation after the first is a bad one: reductions at steps
    # 3 and 6 and 9 ... with patience=1, cooldown=1; the checkpoint of step 5 sits between two of them
    common = [*PLATEAU, "optimizer.schedule.mode=max", "optimizer.schedule.patience=1", "optimizer.schedule.cooldown=1",
              "optimizer.schedule.factor=0.5", "loop.max_steps=12", "loop.eval_every=1", "loop.log_every=1",
              "checkpoint.every_steps=5", "checkpoint.keep_last=5"]
    whole, _ = fixtures.fit(tmp_path / "whole", *common)
    expected = rates(tmp_path / "whole")
    assert len({expected[s] for s in range(1, 6)}) >= 2 and len({expected[s] for s in range(6, 13)}) >= 2
    resumed, _ = fixtures.fit(tmp_path / "resumed", *common,
                              f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step-00000005'}")
    got = rates(tmp_path / "resumed")
    assert {s: got[s] for s in range(6, 13)} == {s: expected[s] for s in range(6, 13)}
    assert all(torch.equal(a, b) for a, b in zip(whole.model.state_dict().values(),
                                                   resumed.model.state_dict().values()))


class ScaleAt:
    """Halves the learning rate through ``run.scale_lr`` at step ``step``."""

    name = "scale_at"

    def __init__(self, step: int):
        self.step = step

    @csf.hookimpl
    def on_train_step_end(self, run, step):
        if step == self.step:
            run.scale_lr(0.5)


@pytest.mark.parametrize("schedule", [["optimizer.schedule.name=cosine"], ["optimizer.schedule.name=linear"],
                                      ["optimizer.schedule._target_=torch.optim.lr_scheduler.CosineAnnealingLR",
                                       "+optimizer.schedule.args.T_max=10"]])
def test_scale_lr_is_respected_by_every_schedule_and_kept_across_a_resume(tmp_path, schedule):
    common = [*schedule, "loop.max_steps=10", "loop.log_every=1", "checkpoint.every_steps=5", "checkpoint.keep_last=5"]
    fixtures.fit(tmp_path / "plain", *common)
    fixtures.fit(tmp_path / "scaled", *common, plugins=[ScaleAt(3)])
    plain, scaled = rates(tmp_path / "plain"), rates(tmp_path / "scaled")
    assert all(scaled[s] == plain[s] for s in range(1, 4))  # logged before the plugin scaled at step 3
    assert all(math.isclose(scaled[s], plain[s] / 2, rel_tol=1e-12) for s in range(4, 10))
    fixtures.fit(tmp_path / "resumed", *common,
                 f"checkpoint.resume={tmp_path / 'scaled' / 'checkpoints' / 'step-00000005'}")
    resumed = rates(tmp_path / "resumed")
    assert {s: resumed[s] for s in range(6, 10)} == {s: scaled[s] for s in range(6, 10)}


def test_scale_lr_refuses_a_factor_that_is_no_positive_number(tmp_path):
    run = csf.Run(fixtures.compose(), output_dir=tmp_path)
    for factor in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="above 0"):
            run.scale_lr(factor)


def test_torch_s_reduce_lr_on_plateau_as_a_target_is_refused_before_the_run_pointing_to_plateau(tmp_path):
    cfg = fixtures.compose("optimizer.schedule._target_=torch.optim.lr_scheduler.ReduceLROnPlateau")
    with pytest.raises(csf.ValidationError, match="optimizer.schedule.name=plateau"):
        csf.Run(cfg, output_dir=tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["data.val=null"], "it steps on evaluations, and this run has none"),
    (["optimizer.schedule.factor=1.5"], "optimizer.schedule.factor"),
    (["optimizer.schedule.patience=-1"], "optimizer.schedule.patience"),
])
def test_plateau_settings_that_cannot_work_are_refused(tmp_path, overrides, message):
    with pytest.raises(csf.ValidationError, match=message):
        csf.Run(fixtures.compose(*PLATEAU, *overrides), output_dir=tmp_path)


def test_a_monitor_no_evaluation_reports_fails_at_the_first_evaluation_naming_those_it_did(tmp_path):
    with pytest.raises(csf.ConfigError, match=r"optimizer.schedule.monitor: .*'val/los'.*val/accuracy, val/loss"):
        fixtures.fit(tmp_path, *PLATEAU, "optimizer.schedule.monitor=val/los", "loop.eval_every=2")


def test_a_training_monitor_not_yet_logged_says_to_log_as_often_as_evaluating(tmp_path):
    """``monitor=train/loss`` with evaluations more often than logs: the first evaluation has no training
    metric yet; the refusal said only that it was not reported (and a run evaluating once, after its final
    log, completed), now it says why and what to change."""
    with pytest.raises(csf.ConfigError, match=r"'train/loss' \(training's metrics are those of the last log.*"
                                              "log at least as often as you evaluate"):
        fixtures.fit(tmp_path, *PLATEAU, "optimizer.schedule.monitor=train/loss", "loop.eval_every=2",
                     "loop.log_every=5")


def test_a_checkpoint_s_forged_plateau_state_is_refused_as_damaged(tmp_path):
    from csframework.builtin.checkpoint.readback import schedule_problems

    run, _ = fixtures.fit(tmp_path, *PLATEAU, "loop.max_steps=2", "loop.eval_every=1")
    state = run.scheduler.state_dict()
    groups = len(run.optimizer.param_groups)
    assert schedule_problems(state, groups) == []
    forged = {
        "scale": ({**state, "scale": -1.0}, "scheduler.scale"),
        "plateau.scale": ({**state, "plateau": {**state["plateau"], "scale": 2.0}}, "scheduler.plateau.scale"),
        "plateau.bad": ({**state, "plateau": {**state["plateau"], "bad": -3}}, "scheduler.plateau.bad"),
        "plateau.best": ({**state, "plateau": {**state["plateau"], "best": float("nan")}}, "scheduler.plateau.best"),
        "plan.factor": ({**state, "plan": {**state["plan"], "factor": 4.0}}, "scheduler.plan.factor"),
        "plan.mode": ({**state, "plan": {**state["plan"], "mode": "sideways"}}, "scheduler.plan.threshold_mode/mode"),
    }
    for name, (bad, key) in forged.items():
        problems = schedule_problems(bad, groups)
        assert any(p.startswith(key) for p in problems), (name, problems)
