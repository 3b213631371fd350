"""Epochs as a unit: ``loop.eval_every_epochs``, ``checkpoint.every_epochs`` and
``optimizer.schedule.warmup_epochs`` (issue 49 item 2)."""
from __future__ import annotations

import pytest

import csframework as csf
import fixtures
from csframework.errors import ValidationError
from csframework.hookspecs import hookimpl

# Blobs: 256 samples in batches of 16, 16 batches (steps) an epoch
EPOCHS = ["loop.max_steps=null", "loop.max_epochs=3", "loop.log_every=1"]


class Evaluations:
    name = "evaluations"

    def __init__(self):
        self.steps: list[int] = []

    @hookimpl
    def on_eval_end(self, run):
        self.steps.append(run.global_step)


def fit(tmp_path, *overrides):
    evaluations = Evaluations()
    run = csf.Run(fixtures.compose(*EPOCHS, *overrides), output_dir=tmp_path, plugins=[evaluations])
    assert run.fit()["status"] == "completed"
    return run, evaluations.steps


@pytest.mark.slow
@pytest.mark.parametrize("every, steps", [(1, [16, 32, 48]), (2, [32, 48])])
def test_evaluation_every_n_epochs_is_at_those_epochs_ends_and_the_last_step(tmp_path, every, steps):
    _, evaluated = fit(tmp_path, f"loop.eval_every_epochs={every}")
    assert evaluated == steps


def test_an_epoch_ends_at_its_last_whole_step_when_steps_accumulate_across_epochs(tmp_path):
    # 3 micro-batches a step: epoch 0 ends with step 5 (batch 15), epoch 1 with step 10 (its batch 13)
    _, evaluated = fit(tmp_path, "loop.max_epochs=2", "loop.grad_accum_steps=3", "loop.eval_every_epochs=1")
    assert evaluated == [5, 10]


@pytest.mark.slow
def test_checkpoints_every_n_epochs_are_written_after_that_epochs_evaluation(tmp_path):
    run, evaluated = fit(tmp_path, "loop.eval_every_epochs=1", "checkpoint.every_epochs=2", "checkpoint.keep_last=5")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert names == ["step-00000032", "step-00000048"]  # the end of epoch 2, and the stage's end
    state = csf.load_checkpoint(tmp_path / "checkpoints" / "step-00000032")
    val = {row["step"]: row["value"] for row in csv_rows(tmp_path) if row["name"] == "val/loss"}
    assert evaluated == [16, 32, 48] and state.metrics["val/loss"] == val["32"]


def test_a_warm_up_in_epochs_is_resolved_from_the_steps_an_epoch_makes(tmp_path):
    run, _ = fit(tmp_path, "optimizer=sgd", "optimizer.lr=0.1", "optimizer.schedule.warmup_epochs=0.5",
                 "loop.max_epochs=1")
    assert run.scheduler.cfg.schedule.warmup_steps == 8
    lrs = [row["value"] for row in csv_rows(tmp_path) if row["name"] == "lr"]
    assert lrs[:9] == pytest.approx([0.1 * k / 8 for k in range(2, 9)] + [0.1, 0.1])


def test_a_warm_up_in_epochs_replaces_the_optimizer_groups_default_in_steps(tmp_path):
    run, _ = fit(tmp_path, "optimizer=adamw", "optimizer.schedule.warmup_epochs=1", "loop.max_epochs=1")
    assert run.scheduler.cfg.schedule.warmup_steps == 16  # not adamw's 30


@pytest.mark.parametrize("settings, problem", [
    (["loop.eval_every=5", "loop.eval_every_epochs=1"],
     "loop.eval_every, loop.eval_every_epochs: both are set (5 steps, 1 epochs); evaluate by steps or by epochs: "
     "set the other to null (e.g. loop.eval_every=null)"),
    (["checkpoint.every_steps=5", "checkpoint.every_epochs=1"],
     "checkpoint.every_steps, checkpoint.every_epochs: both are set (5 steps, 1 epochs); save by steps or by "
     "epochs: set the other to null"),
    (["optimizer.schedule.warmup_steps=5", "optimizer.schedule.warmup_epochs=1"],
     "optimizer.schedule.warmup_steps, optimizer.schedule.warmup_epochs: both are set (5 steps, 1.0 epochs); "
     "keep one"),
    (["loop.eval_every_epochs=0"], "loop.eval_every_epochs: 0 must be"),
])
def test_steps_and_epochs_of_one_setting_together_are_refused(tmp_path, settings, problem):
    with pytest.raises(ValidationError) as e:
        csf.Run(fixtures.compose(*EPOCHS, *settings), output_dir=tmp_path)
    assert [p for p in e.value.problems if p.startswith(problem)], e.value.problems


def csv_rows(run_dir):
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        return [dict(row, value=float(row["value"])) for row in csv.DictReader(f)]
