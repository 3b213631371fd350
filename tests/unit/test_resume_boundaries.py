"""A resumed run trains as the uninterrupted one where its checkpoint sits on a boundary: at the end of a
stage (after its final evaluation), after a stop request's final evaluation, at the end of a stage that
ended inside a gradient-accumulation step. Evaluation never changes training: it draws from generators of
its own. (Mid-epoch and end-of-epoch positions: ``test_batched_fetch``.)"""
from __future__ import annotations

import json

import torch

import csframework as csf
from csframework.state import RunState

import fixtures

#: Random validation data (augmentations drawn in process) and dropout: an evaluation that drew from the
#: training generators would change the training that follows it.
RANDOM = ["data.train._target_=fixtures.tensor_blobs", "data.val._target_=fixtures.AugmentedBlobs",
          "+model.net.dropout=0.2"]


class Record:
    """Every training loss, and each evaluation's (stage, step, metrics)."""

    name = "record"

    def __init__(self):
        self.losses, self.evals = [], []

    @csf.hookimpl
    def on_train_batch_end(self, outputs):
        self.losses.append(float(outputs["loss"]))

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        self.evals.append((run.stage, run.global_step, dict(metrics)))


class StopAt:
    name = "stop_at"

    def __init__(self, step: int):
        self.step = step

    @csf.hookimpl
    def on_train_batch_end(self, run):
        if run.global_step == self.step:
            run.request_stop("enough")


def fit(output_dir, *overrides, plugins=()) -> tuple[Record, dict]:
    record = Record()
    run = csf.Run(fixtures.compose(*overrides), output_dir=output_dir, plugins=[record, *plugins])
    assert run.fit()["status"] == "completed"
    return record, {k: v.clone() for k, v in run.model.state_dict().items()}


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_evaluating_more_often_does_not_change_training(tmp_path):
    rarely, rarely_params = fit(tmp_path / "rarely", *RANDOM, "loop.max_steps=24", "loop.eval_every=null")
    often, often_params = fit(tmp_path / "often", *RANDOM, "loop.max_steps=24", "loop.eval_every=4")
    assert len(often.evals) == 6 and len(rarely.evals) == 1
    assert often.losses == rarely.losses
    assert_same_params(often_params, rarely_params)
    assert often.evals[-1][2] == rarely.evals[-1][2], "the evaluation of a step is the same in every run"


def test_a_run_resumed_at_the_end_of_a_stage_neither_evaluates_it_again_nor_trains_differently(tmp_path):
    stages = [*RANDOM, "+stages.warm.loop.max_steps=16", "+stages.main.loop.max_steps=6"]
    straight, straight_params = fit(tmp_path / "straight", *stages)
    # the default checkpointing: one checkpoint at each stage's end, after its final evaluation
    resumed, resumed_params = fit(tmp_path / "resumed", *stages,
                                  f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000016'}")
    assert [e[:2] for e in straight.evals] == [("warm", 16), ("main", 22)]
    assert [e[:2] for e in resumed.evals] == [("main", 22)]
    assert resumed.losses == straight.losses[16:]
    assert resumed.evals[-1] == straight.evals[-1]
    assert_same_params(straight_params, resumed_params)


def test_a_run_stopped_by_request_stop_and_resumed_trains_as_one_that_went_on(tmp_path):
    straight, straight_params = fit(tmp_path / "straight", *RANDOM, "loop.max_steps=20")
    fit(tmp_path / "run", *RANDOM, "loop.max_steps=16", plugins=[StopAt(12)])  # evaluates, then saves step 12
    resumed, resumed_params = fit(tmp_path / "run", *RANDOM, "loop.max_steps=20", "checkpoint.resume=auto")
    assert resumed.losses == straight.losses[12:]
    assert_same_params(straight_params, resumed_params)


def test_a_stage_that_ends_inside_an_accumulated_step_drops_its_gradients(tmp_path):
    # 256 samples in batches of 16, 3 micro-batches a step: one epoch is 5 steps and 1 micro-batch left over
    stages = ["data.train._target_=fixtures.tensor_blobs", "optimizer=sgd", "optimizer.lr=0.1",
              "+stages.warm.loop.max_epochs=1", "+stages.warm.loop.max_steps=null",
              "+stages.warm.loop.grad_accum_steps=3", "+stages.main.loop.max_steps=4"]
    straight, straight_params = fit(tmp_path / "straight", *stages)
    resumed, resumed_params = fit(tmp_path / "resumed", *stages,
                                  f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000005'}")
    assert len(straight.losses) == 16 + 4
    assert resumed.losses == straight.losses[16:], "the next stage starts without the left-over gradients"
    assert_same_params(straight_params, resumed_params)
    events = [json.loads(line) for line in (tmp_path / "straight" / "events.jsonl").read_text().splitlines()]
    dropped = [e for e in events if e["event"] == "partial_step_dropped"]
    assert len(dropped) == 1 and dropped[0]["level"] == "warning" and dropped[0]["stage"] == "warm"
    assert dropped[0]["micro_batches"] == 1 and dropped[0]["grad_accum_steps"] == 3
    assert "loop.grad_accum_steps" in dropped[0]["problem"]


def test_a_checkpoint_from_before_last_eval_step_existed_still_loads():
    state = RunState()
    old = {"global_step": 7, "stage_index": 0, "stage_step": 7, "epoch": 0, "batch_in_epoch": 7, "micro_step": 7}
    state.restore_position(old)
    assert state.global_step == 7 and state.last_eval_step == -1
    assert state.position() == old | {"last_eval_step": -1}
