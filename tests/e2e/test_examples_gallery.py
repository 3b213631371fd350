"""The examples gallery (issue 40 item 3): each example runs, in a short form, with a command its README
shows, and reaches a stated result (a loss below a bound, an accuracy above one), not only exit 0.
examples/classify has its own tests (test_example.py, test_collect_example.py)."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

import fixtures
from gallery import EXAMPLES, readme, run, summary

pytestmark = pytest.mark.slow


# -- char_gpt --------------------------------------------------------------------------------------------
CHAR_GPT = "python -m csframework --config-dir conf +experiment=shakespeare_char"
#: a smaller model on the first 60,000 characters of the stdlib's source, a short warm-up
CHAR_GPT_SHORT = (" data.train.num_chars=60000 model.layers=2 model.width=64 model.heads=2 loop.max_steps=60"
                  " loop.eval_every=null loop.eval_steps=4 loop.log_every=20 optimizer.lr=3e-3"
                  " optimizer.schedule.warmup_steps=5 optimizer.schedule.min_lr=3e-4 checkpoint.every_steps=null")


def test_char_gpt_learns_characters_and_sample_py_generates_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "chars"
    run("char_gpt", CHAR_GPT, f"{CHAR_GPT_SHORT} hydra.run.dir={run_dir}")
    metrics = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()[1:]]
    val = [(int(step), float(value)) for step, _, name, value in metrics if name == "val/loss"]
    assert [step for step, _ in val] == [0, 60]  # loop.eval_at_start: the untrained model's loss first
    assert val[0][1] > 4.0 and val[1][1] < 3.0, val  # ln(alphabet) ~ 4.5 at the start
    events = fixtures.events(run_dir)
    groups = events[0]["param_groups"]
    assert groups[0].startswith("default: ") and groups[1].startswith("no_decay: ")

    sampled = subprocess.run([sys.executable, "sample.py", str(run_dir), "--start", "def ", "--chars", "40"],
                             cwd=EXAMPLES / "char_gpt", capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("def ") and len(sampled.stdout.rstrip("\n")) >= 44

    # score.py: the loss over every validation window (the README's comparison with nanoGPT), which the
    # run's 4-batch estimate approximates
    scored = subprocess.run([sys.executable, "score.py", str(run_dir)], cwd=EXAMPLES / "char_gpt",
                            capture_output=True, text=True, timeout=120)
    assert scored.returncode == 0, scored.stderr
    windows, loss = scored.stdout.split("over all ")[1].split(" windows: ")
    assert int(windows) == (6000 - 65) // 64 + 1  # the non-overlapping windows of the last 10% of 60,000
    assert float(loss) < 3.0 and abs(float(loss) - val[1][1]) < 0.25, (loss, val)


# -- digits ----------------------------------------------------------------------------------------------
DIGITS = "python -m csframework --config-dir conf +experiment=digits"


@fixtures.needs("sklearn")
def test_digits_reaches_high_accuracy_on_scikit_learns_split(tmp_path):
    run("digits", DIGITS, f" loop.max_epochs=4 loop.eval_every=null hydra.run.dir={tmp_path}")
    assert summary(tmp_path)["metrics"]["val/accuracy"] > 0.9


# -- csx_walkthrough ------------------------------------------------------------------------------------
WALKTHROUGH = "python -m csframework --config-dir conf +experiment=walkthrough"


def test_csx_walkthrough_error_fix_and_compile_only(tmp_path):
    failed = run("csx_walkthrough", WALKTHROUGH, f" hydra.run.dir={tmp_path / 'branch'}", status=1)
    error = failed.stderr.strip().splitlines()[-1]
    assert error.startswith("csframework: error: Python control flow on a tensor value at ")
    assert "gated.py:20 in forward" in error and "torch.where" in error and "Traceback" not in failed.stderr

    fixed = WALKTHROUGH + " model.net._target_=gated.WhereGatedNet"
    run("csx_walkthrough", fixed, f" hydra.run.dir={tmp_path / 'fixed'}")
    result = summary(tmp_path / "fixed")
    assert result["status"] == "completed" and result["traces"] == 1
    assert result["metrics"]["val/accuracy"] > 0.9

    compile_only = fixed + " backend.compile_only=true"
    run("csx_walkthrough", compile_only, f" hydra.run.dir={tmp_path / 'compiled'}")
    assert summary(tmp_path / "compiled")["status"] == "compiled"
    report = json.loads((tmp_path / "compiled" / "compile_report.json").read_text())
    assert report["ops"]["by_op"]["aten.where.self"] >= 1
    assert not (tmp_path / "compiled" / "checkpoints").exists()


# -- plugin_package -------------------------------------------------------------------------------------
PLUGIN_RUN = ("python -m csframework model=tiny_linear data=tiny_clusters optimizer=sgd optimizer.lr=0.1 "
              "loop.max_steps=200 loop.eval_every=5 loop.eval_steps=null target.metric=val/accuracy "
              "target.mode=max target.value=0.9")


def test_plugin_package_installs_and_is_active_and_its_own_tests_pass(tmp_path):
    site = tmp_path / "site"
    fixtures.pip_install_target(EXAMPLES / "plugin_package", site)
    env = {"PYTHONPATH": str(site), "CSFRAMEWORK_PLUGINS_AUTOLOAD": "target"}
    run("plugin_package", PLUGIN_RUN, f" hydra.run.dir={tmp_path / 'run'}", env=env)
    result = summary(tmp_path / "run")
    assert result["stop_reason"] == "val/accuracy reached 0.9"
    assert result["target_reached_at"] == result["global_step"] < 200

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                           cwd=EXAMPLES / "plugin_package", capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(site)})
    assert tests.returncode == 0 and "4 passed" in tests.stdout, tests.stdout[-3000:]


# -- sweep -----------------------------------------------------------------------------------------------
SWEEP = "python -m csframework -m --config-dir conf +experiment=curve_sweep"


@fixtures.needs("hydra_plugins.hydra_optuna_sweeper")
def test_sweep_searches_lr_and_weight_decay_and_writes_its_table(tmp_path):
    run("sweep", SWEEP, f" hydra.sweeper.n_trials=3 loop.max_steps=150 hydra.sweep.dir={tmp_path}")
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert len(rows) == 3 and all(row["status"] == "completed" for row in rows)
    swept = [(float(row["optimizer.lr"]), float(row["optimizer.weight_decay"])) for row in rows]  # as overridden
    assert len(set(swept)) == 3 and all(1e-4 <= lr <= 3e-2 and 0 <= wd <= 1 for lr, wd in swept)
    assert min(row["val/loss"] for row in rows) < 0.35  # the curve's variance (predicting its mean): 0.425
    assert (tmp_path / "optimization_results.yaml").exists()
    assert (tmp_path / "sweep.png").exists() or (tmp_path / "sweep.svg").exists()


# -- word_lm ---------------------------------------------------------------------------------------------
WORD_LM = "python -m csframework --config-dir conf +experiment=word_lm"
#: the README's short form: the first 12,000 words (14 training batches of [35, 20] an epoch), a 500-word
#: vocabulary, a small LSTM, 4 epochs
WORD_LM_SHORT = (WORD_LM + " data.train.num_words=12000 data.train.max_vocab=500 model.embed=32 model.hidden=32"
                 " loop.max_epochs=4")


@fixtures.needs("torchmetrics")
def test_word_lm_evaluates_each_epoch_lowers_lr_on_a_plateau_and_tests_the_best_model(tmp_path):
    assert WORD_LM in readme("word_lm")
    run("word_lm", WORD_LM_SHORT, f" loop.log_every=1 hydra.run.dir={tmp_path}")
    result = summary(tmp_path)
    rows = [line.split(",") for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:]]
    val = {int(step): float(value) for step, _, name, value in rows if name == "val/loss"}
    lrs = {int(step): float(value) for step, _, name, value in rows if name == "lr"}
    assert sorted(val) == [14, 28, 42, 56]  # loop.eval_every_epochs=1: each epoch's end, nothing between

    # plateau (factor 0.25, patience 0, threshold 0): after an evaluation that is no better than the best
    # so far, the rate of the next epoch's steps is a quarter of the last one
    expected, best, lr = {}, float("inf"), 20.0
    for end in sorted(val):
        expected.update({step: lr for step in range(end - 13, end + 1)})
        lr = lr if val[end] < best else lr / 4
        best = min(best, val[end])
    assert {step: lrs[step] for step in expected} == pytest.approx(expected)
    assert min(expected.values()) < 20.0, "the short form no longer exercises a reduction"

    # the best evaluation's checkpoint is the one tested; perplexity over each whole set is exp(loss)
    best_step = min(val, key=val.get)
    assert result["tested_weights"] == result["best_checkpoint"]["path"] == f"checkpoints/step-{best_step:08d}"
    metrics = result["metrics"]
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-4)
    assert metrics["test/ppl"] == pytest.approx(math.exp(metrics["test/loss"]), rel=1e-4)
    assert metrics["test/ppl"] < 500  # the vocabulary's size: what a model that learnt nothing scores


def test_word_lm_streams_are_word_language_models_batchify_and_get_batch():
    words = example_module("word_lm", "words")
    vocab = words.vocabulary(3000, 200)
    ids = [vocab.get(word, 0) for word in words.split_words("val", 3000)]  # 300 words
    stream = words.word_stream("val", streams=7, num_words=3000, max_vocab=200)
    inputs, targets = stream.tensors
    rows = len(ids) // 7
    # column j is the j-th of 7 equal consecutive pieces of the split (the tail that does not fill a row is
    # dropped); the targets are the next row, as get_batch's source[i + 1:i + 1 + seq_len]
    assert inputs.shape == targets.shape == (rows - 1, 7)
    for j in range(7):
        column = ids[j * rows:(j + 1) * rows]
        assert inputs[:, j].tolist() == column[:-1] and targets[:, j].tolist() == column[1:]
    assert len(vocab) == 200 and vocab["<unk>"] == 0


# -- regression ------------------------------------------------------------------------------------------
REGRESSION = "python -m csframework --config-dir conf +experiment=diabetes"
REGRESSION_PREDICT = (REGRESSION + " mode=predict checkpoint.resume=outputs/diabetes"
                      " hydra.run.dir=outputs/diabetes-predictions")


@fixtures.needs("sklearn")
@fixtures.needs("torchmetrics")
def test_regression_beats_ridge_keeps_the_best_evaluation_and_predicts_with_it(tmp_path):
    fitted, predicted = tmp_path / "diabetes", tmp_path / "predictions"
    run("regression", REGRESSION, f" loop.max_epochs=20 hydra.run.dir={fitted}")
    result = summary(fitted)
    rows = [line.split(",") for line in (fitted / "metrics.csv").read_text().splitlines()[1:]]
    val = {int(step): float(value) for step, _, name, value in rows if name == "val/loss"}
    assert sorted(val) == list(range(24, 241, 24))  # every 2 epochs of 12 steps
    best_step = min(val, key=val.get)
    assert result["best_checkpoint"]["path"] == f"checkpoints/step-{best_step:08d}"
    assert {"val/mae", "val/r2"} <= set(result["metrics"])

    # ridge.py scores Ridge and the run's best checkpoint with scikit-learn on the same rows
    compared = subprocess.run([sys.executable, "ridge.py", str(fitted)], cwd=EXAMPLES / "regression",
                              capture_output=True, text=True, timeout=120)
    assert compared.returncode == 0, compared.stderr
    ridge, ours = compared.stdout.splitlines()
    assert ridge.startswith("Ridge:       val MSE 3430.1  MAE 46.14  R2 0.3311")
    assert ours.startswith("csframework: val MSE ")
    assert float(ours.split()[3]) == pytest.approx(val[best_step], abs=0.1)  # the run's own val/loss
    assert val[best_step] < 3430.1

    # mode=predict with the best checkpoint: one row per validation sample, in order, whose MSE is the best
    # evaluation's
    run("regression", REGRESSION_PREDICT, f" checkpoint.resume={fitted} hydra.run.dir={predicted}")
    assert summary(predicted)["predictions"]["rows"] == 89
    lines = [json.loads(line) for line in (predicted / "predictions.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(89))
    y_val = diabetes_split()[3]
    mse = sum((line["preds"] - y) ** 2 for line, y in zip(lines, y_val)) / len(y_val)
    assert mse == pytest.approx(val[best_step], rel=1e-5)


def diabetes_split():
    """examples/regression/diabetes.py's ``split()``."""
    return example_module("regression", "diabetes").split()


def example_module(example: str, name: str):
    """``examples/<example>/<name>.py``, the example's own module, imported from its file."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / example / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
