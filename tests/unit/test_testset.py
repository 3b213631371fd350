"""The test sets (issue 49 item 6): ``data.test`` (and ``data.test_sets``) evaluated whole once after
training, with the best checkpoint's weights when ``checkpoint.keep_best`` keeps one, else the last;
``test/*`` in ``summary.json``, ``metrics.csv`` and the end line; ``mode=test`` on a finished run."""
from __future__ import annotations

import csv
import json

import pytest
import torch
from torch import nn

import csframework as csf
from csframework.models import Supervised
import fixtures

TEST = ["+data.test._target_=fixtures.Blobs", "+data.test.n=48", "+data.test.seed=7"]
BEST_FIRST = ["loop.max_steps=8", "loop.eval_every=2", "checkpoint.keep_best.monitor=val/loss",
              "checkpoint.keep_best.mode=max"]  # val/loss falls: under max the best is step 2's


def hand_tested_loss(weights: dict, n: int = 48, seed: int = 7) -> float:
    """The test set's mean cross-entropy with ``weights``, computed by hand over the whole set at once."""
    model = Supervised(fixtures.mlp())
    model.load_state_dict(weights)
    blobs = fixtures.Blobs(n=n, seed=seed)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model.net(blobs.x), blobs.y))


def csv_rows(run_dir, name: str) -> list[tuple[int, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(f) if r["name"] == name]


def test_the_test_set_is_tested_once_after_training_with_the_best_checkpoint_s_weights(tmp_path):
    run, summary = fixtures.fit(tmp_path, *TEST, *BEST_FIRST)
    best = csf.load_checkpoint(tmp_path, which="best")
    assert best.step == 2 and summary["tested_weights"] == "checkpoints/step-00000002"
    tested = summary["metrics"]["test/loss"]
    assert tested == pytest.approx(hand_tested_loss(best.model), rel=1e-5)
    assert tested != pytest.approx(hand_tested_loss(csf.load_checkpoint(tmp_path).model), rel=1e-3)
    assert csv_rows(tmp_path, "test/loss") == [(8, tested)]  # once, at the end
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["metrics"]["test/loss"] == tested and "test/accuracy" in on_disk["metrics"]
    end = [e for e in fixtures.events(tmp_path) if e["event"] == "fit_end"][-1]
    assert end["test/loss"] == round(tested, 5)
    assert all(torch.equal(v, best.model[k]) for k, v in run.model.state_dict().items())  # left loaded


def test_a_run_resumed_at_its_end_keeps_its_test_results(tmp_path):
    """``checkpoint.resume=auto`` on a finished run with ``data.test`` trains and tests nothing: its
    ``summary.json`` (the test metrics, ``tested_weights``, its timings) stays as the fit wrote it; it was
    rewritten without them, since the last checkpoint cannot hold metrics measured after it."""
    _, first = fixtures.fit(tmp_path, *TEST, *BEST_FIRST)
    written = (tmp_path / "summary.json").read_text()
    run, again = fixtures.fit(tmp_path, *TEST, *BEST_FIRST, "checkpoint.resume=auto")
    assert run.already_complete
    assert (tmp_path / "summary.json").read_text() == written
    assert again["metrics"]["test/loss"] == first["metrics"]["test/loss"]
    assert csv_rows(tmp_path, "test/loss") == [(8, first["metrics"]["test/loss"])]  # not tested again


def test_a_summary_with_a_metric_the_checkpoint_does_not_hold_is_rewritten(tmp_path):
    """Only the test sets' metrics may stand beside the checkpoint's: another one (an edited summary) is
    not believed, and the summary is written again from the run."""
    fixtures.fit(tmp_path, *TEST, *BEST_FIRST)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    on_disk["metrics"]["val/planted"] = 1.0
    (tmp_path / "summary.json").write_text(json.dumps(on_disk))
    fixtures.fit(tmp_path, *TEST, *BEST_FIRST, "checkpoint.resume=auto")
    assert "val/planted" not in json.loads((tmp_path / "summary.json").read_text())["metrics"]


def test_without_keep_best_the_last_weights_are_tested(tmp_path):
    run, summary = fixtures.fit(tmp_path, *TEST, "loop.max_steps=6")
    assert summary["tested_weights"] == "last"
    assert summary["metrics"]["test/loss"] == pytest.approx(hand_tested_loss(run.model.state_dict()), rel=1e-5)


def test_named_test_sets_have_metrics_of_their_own(tmp_path):
    _, summary = fixtures.fit(tmp_path, *TEST, "loop.max_steps=4", "+data.test_sets.shifted._target_=fixtures.Blobs",
                              "+data.test_sets.shifted.n=32", "+data.test_sets.shifted.seed=9")
    assert {"test/loss", "shifted/loss", "shifted/accuracy"} <= set(summary["metrics"])
    assert summary["metrics"]["shifted/loss"] != summary["metrics"]["test/loss"]


def test_mode_test_on_a_finished_run_tests_its_best_checkpoint(tmp_path):
    fixtures.fit(tmp_path / "trained", *BEST_FIRST)  # trained without a test set
    best = csf.load_checkpoint(tmp_path / "trained", which="best")
    run = csf.Run(fixtures.compose(*TEST, "mode=test", f"checkpoint.resume={tmp_path / 'trained'}"),
                  output_dir=tmp_path / "tested")
    summary = run.test()
    assert summary["mode"] == "test" and summary["status"] == "completed" and summary["global_step"] == 2
    assert summary["metrics"]["test/loss"] == pytest.approx(hand_tested_loss(best.model), rel=1e-5)
    assert csv_rows(tmp_path / "tested", "test/loss") == [(2, summary["metrics"]["test/loss"])]


@pytest.mark.parametrize("overrides, message", [
    (["+data.test_sets.val._target_=fixtures.Blobs"], "data.test_sets.val: .*'val' is taken"),
    (["+data.test_sets.train._target_=fixtures.Blobs"], "data.test_sets.train: .*'train' is taken"),
    (["+data.test.n=3"], "data.test: needs a _target_"),
])
def test_test_sets_that_cannot_be_named_or_built_are_refused(tmp_path, overrides, message):
    with pytest.raises(csf.ValidationError, match=message):
        csf.Run(fixtures.compose(*overrides), output_dir=tmp_path)


def test_mode_test_without_a_test_set_says_what_to_set(tmp_path):
    with pytest.raises(csf.ConfigError, match="data.test: mode=test needs a test set"):
        csf.Run(fixtures.compose("mode=test"), output_dir=tmp_path).test()


def test_a_run_trained_past_this_config_s_max_steps_is_evaluated_not_called_damaged(tmp_path):
    """``mode=validate``/``test`` of a run trained longer than the config's ``loop.max_steps`` (its default, say)
    refused its checkpoint as damaged ("loop.stage_step: 8 must be between 0 and 4") and advised moving it
    aside; an evaluation continues nothing, so that setting bounds nothing. A fit resumed there is still
    refused, saying which setting to raise (before: as damage, each checkpoint in turn, an earlier one within
    the steps taken in its place)."""
    trained = tmp_path / "trained"
    fixtures.fit(trained, *TEST, "loop.max_steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=4")  # 2, 4: within 4
    for mode in ("validate", "test"):
        run = csf.Run(fixtures.compose(*TEST, "loop.max_steps=4", f"mode={mode}", f"checkpoint.resume={trained}"),
                      output_dir=tmp_path / mode)
        assert getattr(run, mode)()["global_step"] == 8
    summary = (trained / "summary.json").read_bytes()
    with pytest.raises(csf.CsfError) as refused:
        fixtures.fit(trained, *TEST, "loop.max_steps=4", "checkpoint.every_steps=2", "checkpoint.resume=auto")
    assert refused.value.exit_code == 2
    # the newest checkpoint, named with the setting to raise; not called damaged, no fall back to an earlier one
    assert (f"checkpoint {trained / 'checkpoints' / 'step-00000008'}: loop.stage_step: 8 is past this stage's 4 steps"
            in str(refused.value)) and "set loop.max_steps" in str(refused.value)
    assert (trained / "summary.json").read_bytes() == summary
    assert not [e for e in fixtures.events(trained) if e["event"] in ("checkpoint_damaged", "resumed")]
