"""csframework-early-stopping, through the csf_runner fixture of csframework.testing (a tiny fit whose
val/loss flattens out after about 30 steps)."""
import json
import os
import signal

import pytest

import csframework as csf

pytestmark = pytest.mark.slow
ONLY = ["early_stopping"]  # entry-point plugins these runs load
LONG = ["loop.max_steps=60", "loop.eval_every=3"]
RULE = ["early_stopping.patience=2", "early_stopping.min_delta=0.001"]


def expected_stop(val_losses, patience=2, min_delta=0.001):
    """The step at which the rule stops, replayed on an uninterrupted run's (step, val/loss) series."""
    best, wait = None, 0
    for step, value in val_losses:
        if best is None or value < best - min_delta:
            best, wait = value, 0
        else:
            wait += 1
            if wait >= patience:
                return step
    return None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from csframework.testing import CsfRunner

    result = CsfRunner(tmp_path_factory.mktemp("plain")).run(LONG, autoload=ONLY)
    assert result.exit_code == 0, result.error
    return result


def test_installed_but_unconfigured_it_changes_nothing(uninterrupted):
    assert uninterrupted.summary["global_step"] == 60
    assert "stop_reason" not in uninterrupted.summary


def test_stops_when_val_loss_stops_improving(csf_runner, uninterrupted):
    stop = expected_stop(uninterrupted.series("val/loss"))
    assert stop is not None and stop < 60
    result = csf_runner.run(LONG + RULE, autoload=ONLY)
    assert result.exit_code == 0, result.error
    assert result.summary["status"] == "completed"
    assert result.summary["global_step"] == stop
    assert result.summary["stop_reason"].startswith("early_stopping: val/loss did not improve")
    assert result.series("val/loss") == uninterrupted.series("val/loss")[:len(result.series("val/loss"))]
    assert (result.output_dir / "checkpoints" / f"step-{stop:08d}").is_dir()  # the final checkpoint


class SigtermAt:
    """Sends this process SIGTERM at one step: the run stops after the next step boundary, as on a cluster."""

    def __init__(self, step):
        self.step = step

    @csf.hookimpl
    def on_train_batch_end(self, run):
        if run.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_resumed_run_stops_at_the_same_step(csf_runner, uninterrupted):
    stop = expected_stop(uninterrupted.series("val/loss"))
    first = csf_runner.run(LONG + RULE, plugins=[SigtermAt(stop - 3)], autoload=ONLY)
    assert first.exit_code == 143, first.error
    stopped_at = first.summary["global_step"]
    assert stop - 3 <= stopped_at < stop
    meta = json.loads((first.output_dir / "checkpoints" / f"step-{stopped_at:08d}" / "meta.json").read_text())
    assert meta["plugins"]["early_stopping"]["wait"] == 1  # mid-way through the patience: the counter matters

    resumed = csf_runner.run(LONG + RULE + ["checkpoint.resume=auto"], output_dir=first.output_dir, autoload=ONLY)
    assert resumed.exit_code == 0, resumed.error
    assert resumed.summary["global_step"] == stop
    assert resumed.summary["stop_reason"].startswith("early_stopping:")


@pytest.mark.parametrize("overrides, line", [
    (["early_stopping.monitor=train/loss"], "early_stopping.monitor: 'train/loss' is not an evaluation metric"),
    (["data.val=null"], "early_stopping.monitor: val/loss comes from evaluation, but data.val is null"),
    (["early_stopping.patience=0"], "early_stopping.patience: 0 must be >= 1"),
])
def test_an_impossible_setting_is_refused_before_launch(csf_runner, overrides, line):
    result = csf_runner.run(["early_stopping.patience=2", *overrides], autoload=ONLY)
    assert result.exit_code == 2
    assert line in str(result.error)
    assert not (result.output_dir / "checkpoints").exists()


def test_a_metric_evaluation_does_not_report_is_refused_at_the_first_evaluation(csf_runner):
    result = csf_runner.run(["early_stopping.patience=2", "early_stopping.monitor=val/bleu"], autoload=ONLY)
    assert result.exit_code == 2
    assert "early_stopping.monitor: evaluation reported no 'val/bleu' (it reported val/accuracy, val/loss)" \
        in str(result.error)
    assert result.summary["global_step"] == 5


def test_wrong_type_and_unknown_key_name_the_key(csf_runner):
    wrong = csf_runner.run(["early_stopping.patience=soon"], autoload=ONLY)
    assert wrong.exit_code == 2 and str(wrong.error).startswith("early_stopping.patience:")
    unknown = csf_runner.run(["early_stopping.patiense=2"], autoload=ONLY)
    assert unknown.exit_code == 2 and "early_stopping.patiense" in str(unknown.error)


def test_a_stage_may_set_it(csf_runner):
    result = csf_runner.run(LONG + ["+stages.only.early_stopping.patience=2",
                                    "+stages.only.early_stopping.min_delta=0.001"], autoload=ONLY)
    assert result.exit_code == 0, result.error
    assert result.summary["global_step"] < 60


def test_a_compiled_run_stops_where_its_own_val_loss_says(csf_runner):
    """backend.compile=true: the rule reads the compiled evaluation's metrics as it reads eager ones."""
    result = csf_runner.run(LONG + RULE + ["backend.compile=true"], autoload=ONLY)
    assert result.exit_code == 0, result.error
    assert result.summary["compile"]["graph_breaks"] == 0
    stop = expected_stop(result.series("val/loss"))
    assert stop is not None and result.summary["global_step"] == stop
    assert result.summary["stop_reason"].startswith("early_stopping: val/loss did not improve")
