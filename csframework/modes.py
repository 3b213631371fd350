"""The run's modes that train nothing: ``validate``, ``test`` and ``predict`` (``Run.validate`` ...), each
set up and torn down as a fit is: ``on_fit_start`` (the checkpoint plugin restores ``checkpoint.resume``
first), the work, ``on_fit_end`` (the summary written), with ``run.mode`` and ``run.status`` saying what the
run is doing meanwhile, so logging, metrics and ``summary.json`` work as in a fit."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from . import evaluation, predict as predictions, testset
from .data import NO_PREDICT_SET
from .errors import ConfigError
from .fresh_run import writing

if TYPE_CHECKING:
    from .protocol import LoopRun


def validate(run: LoopRun) -> dict:
    """Evaluate on ``data.val`` once (``mode=validate``); returns the run's summary, as ``fit`` does, whose
    ``metrics`` hold the ``val/*`` results. ``run.mode == "validate"`` and ``run.status == "validating"``
    meanwhile; the checkpoint plugin restores ``checkpoint.resume`` first (a path evaluates a trained run's
    weights). After ``fit`` on the same ``Run``, it evaluates the trained weights."""
    if run.val_loader is None:
        raise ConfigError("data.val: mode=validate needs a validation dataset")
    return _once(run, "validate", "validating", lambda: evaluation.evaluate(run))


def test(run: LoopRun) -> dict:
    """Evaluate the test sets (``data.test``, ``data.test_sets``) once, whole (``mode=test``,
    ``csframework.testset``), with the weights of ``checkpoint.resume``: a run directory's best checkpoint
    (``checkpoint.keep_best``), else its newest; returns the run's summary, whose ``metrics`` hold
    ``test/*``. A fit with test sets tests them itself when it ends."""
    if not testset.has_test_sets(run):
        raise ConfigError("data.test: mode=test needs a test set; set data.test (or data.test_sets.<name>)")
    return _once(run, "test", "testing", lambda: testset.test_pass(run))


def predict(run: LoopRun) -> dict:
    """Write the model's per-sample outputs for ``data.predict`` to ``predictions.jsonl`` in the run
    directory (``mode=predict``, ``csframework.predict``), with the weights ``test`` would use; returns the
    run's summary, whose ``predictions`` names the file, its rows and the outputs written."""
    if run.stage_config.data.predict is None:
        raise ConfigError(NO_PREDICT_SET)
    return _once(run, "predict", "predicting", lambda: predictions.predict_pass(run))


def _once(run, mode: str, status: str, work: Callable[[], object]) -> dict:
    def body():
        run.mode, run.status = mode, status
        run.hooks.on_fit_start(run=run)
        work()
        run.status = "completed"
        run.hooks.on_fit_end(run=run)
        return run.summary()

    with writing(run, first=not run._started):  # the fresh-run rule, as for a fit
        run._started = True  # what it writes is this run's: a fit after it goes on in the directory
        return run._guarded(body)
