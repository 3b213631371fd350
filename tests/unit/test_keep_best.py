"""``checkpoint.keep_best`` (issue 49 item 5): an evaluation that improves on the best so far is saved at
once, whatever ``checkpoint.every_steps`` says, so ``csf.load_checkpoint(which="best")`` returns the best
evaluation's weights; a later best replaces the earlier one (the index names it first, then the old one is
pruned); a resumed run goes on comparing with the best it recorded."""
from __future__ import annotations

import csv
import json

import torch

import csframework as csf
import fixtures


class ScriptedScore:
    """Reports ``val/score`` at each evaluation from a script of values (the monitor), in ``on_eval_end``."""

    name = "scripted_score"

    def __init__(self, values):
        self.values = list(values)
        self.evaluations = 0

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        run.report({"val/score": self.values[self.evaluations]})
        self.evaluations += 1


def index(run_dir):
    return json.loads((run_dir / "checkpoints" / "index.json").read_text())


def test_the_best_checkpoint_is_the_best_evaluation_s_with_every_steps_null(tmp_path):
    # val/loss falls as the run trains, so under mode=max its best is the first evaluation (step 2)
    run, summary = fixtures.fit(tmp_path, "loop.max_steps=8", "loop.eval_every=2", "checkpoint.every_steps=null",
                                "checkpoint.keep_best.monitor=val/loss", "checkpoint.keep_best.mode=max")
    with open(tmp_path / "metrics.csv") as f:
        evaluated = {int(row["step"]): float(row["value"]) for row in csv.DictReader(f) if row["name"] == "val/loss"}
    assert sorted(evaluated) == [2, 4, 6, 8] and max(evaluated, key=lambda s: evaluated[s]) == 2
    best = csf.load_checkpoint(tmp_path, which="best")
    assert best.step == 2 and best.metrics["val/loss"] == evaluated[2]
    assert summary["best_checkpoint"] == {"path": "checkpoints/step-00000002", "metric": "val/loss",
                                          "value": evaluated[2]}
    assert csf.load_checkpoint(tmp_path).step == 8  # the end's, as every_steps=null says
    assert not all(torch.equal(best.model[k], v) for k, v in run.model.state_dict().items())


def test_a_later_best_replaces_the_earlier_one(tmp_path):
    scores = [3.0, 1.0, 2.0, 0.5, 4.0]
    run, summary = fixtures.fit(tmp_path, "loop.max_steps=10", "loop.eval_every=2", "checkpoint.keep_last=1",
                                "checkpoint.keep_best.monitor=val/score", plugins=[ScriptedScore(scores)])
    saved = [e["path"].rsplit("/", 1)[1] for e in fixtures.events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert saved == ["step-00000002", "step-00000004", "step-00000008", "step-00000010"]  # each improvement
    assert index(tmp_path)["best"] == {"name": "step-00000008", "metric": "val/score", "value": 0.5}
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000008", "step-00000010"]
    assert csf.load_checkpoint(tmp_path, which="best").step == 8


def test_a_resumed_run_compares_with_the_best_it_recorded(tmp_path):
    fixtures.fit(tmp_path, "loop.max_steps=4", "loop.eval_every=2", "checkpoint.keep_best.monitor=val/score",
                 plugins=[ScriptedScore([2.0, 1.0])])
    assert index(tmp_path)["best"]["name"] == "step-00000004"
    fixtures.fit(tmp_path, "loop.max_steps=8", "loop.eval_every=2", "checkpoint.keep_best.monitor=val/score",
                 "checkpoint.resume=auto", plugins=[ScriptedScore([1.5, 0.25])])
    saved = [e["path"].rsplit("/", 1)[1] for e in fixtures.events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert saved == ["step-00000002", "step-00000004", "step-00000008"]  # 1.5 at step 6 is no better than 1.0
    assert index(tmp_path)["best"] == {"name": "step-00000008", "metric": "val/score", "value": 0.25}


def test_a_training_metric_chooses_among_the_checkpoints_saved_anyway(tmp_path):
    # train/loss is logged every step: saving at each of its improvements would write a checkpoint a step
    fixtures.fit(tmp_path, "loop.max_steps=8", "loop.log_every=1", "checkpoint.every_steps=4",
                 "checkpoint.keep_best.monitor=train/loss")
    saved = [e["path"].rsplit("/", 1)[1] for e in fixtures.events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert saved == ["step-00000004", "step-00000008"]
    assert index(tmp_path)["best"]["name"] in saved
