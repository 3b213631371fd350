"""Predictions out (issue 49 item 9): ``mode=predict`` writes the model's per-sample outputs for
``data.predict`` to ``predictions.jsonl`` (one row per sample: ``index`` and the outputs), with the best
checkpoint's weights of the run ``checkpoint.resume`` names; ``csf.load_model`` rebuilds the model from a
checkpoint's own config and weights, refusing a config that names anything but classes."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

import csframework as csf
from csframework.models import Supervised
import fixtures

BEST_FIRST = ["loop.max_steps=8", "loop.eval_every=2", "checkpoint.keep_best.monitor=val/loss",
              "checkpoint.keep_best.mode=max"]  # val/loss falls: under max the best is step 2's


def unlabelled(n: int = 20):
    """Inputs without targets (``TensorDataset(x)``): what a prediction set holds."""
    return torch.utils.data.TensorDataset(fixtures.Blobs(n=n, seed=5).x)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("predict") / "run"
    fixtures.fit(run_dir, *BEST_FIRST)
    return run_dir


def test_load_model_rebuilds_the_model_with_the_best_weights(trained):
    model = csf.load_model(trained, which="best")
    best = csf.load_checkpoint(trained, which="best")
    assert isinstance(model, Supervised) and not model.training and best.step == 2
    assert all(torch.equal(v, best.model[k]) for k, v in model.state_dict().items())
    newest = csf.load_model(trained)
    assert not all(torch.equal(v, best.model[k]) for k, v in newest.state_dict().items())


def test_mode_predict_writes_one_row_per_sample_with_the_best_weights(trained, tmp_path):
    cfg = fixtures.compose("mode=predict", f"checkpoint.resume={trained}", "data.eval_batch_size=8",
                           f"+data.predict._target_={__name__}.unlabelled")
    summary = csf.Run(cfg, output_dir=tmp_path).predict()
    assert summary["mode"] == "predict" and summary["predictions"] == {
        "path": "predictions.jsonl", "rows": 20, "outputs": ["logits", "preds"]}
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(20))
    expected = csf.load_model(trained, which="best")(unlabelled().tensors[0])
    assert [r["preds"] for r in rows] == expected["preds"].tolist()
    assert torch.allclose(torch.tensor([r["logits"] for r in rows]), expected["logits"], atol=1e-6)


def test_mode_predict_without_a_dataset_says_what_to_set(tmp_path):
    with pytest.raises(csf.ConfigError, match="data.predict: mode=predict needs a dataset"):
        csf.Run(fixtures.compose("mode=predict"), output_dir=tmp_path).predict()


def forged(trained, tmp_path, model_config):
    """A copy of the trained run's best checkpoint whose config.yaml names ``model_config``, its size and
    checksum rewritten in meta.json (a forger can)."""
    from csframework.builtin.checkpoint import file_crc32

    source = csf.load_checkpoint(trained, which="best").path
    target = tmp_path / "step-00000002"
    shutil.copytree(source, target)
    config = yaml.safe_load((target / "config.yaml").read_text())
    config["model"] = model_config
    (target / "config.yaml").write_text(yaml.safe_dump(config))
    meta = json.loads((target / "meta.json").read_text())
    meta["files"]["config.yaml"] = {**meta["files"]["config.yaml"], "bytes": (target / "config.yaml").stat().st_size,
                                    "crc32": file_crc32(target / "config.yaml")}
    (target / "meta.json").write_text(json.dumps(meta))
    return target


@pytest.mark.parametrize("model_config, message", [
    ({"_target_": "os.system", "command": "true"}, "model._target_ os.system is no torch.nn.Module class"),
    ({"_target_": "collections.OrderedDict"}, "is no torch.nn.Module"),
    ({"_target_": "csframework.models.Supervised", "net": {"_target_": "subprocess.Popen", "args": ["true"]}},
     "model.net._target_ subprocess.Popen is neither"),
    ({"_target_": "csframework.models.Supervised", "net": {"_target_": "torch.hub.load", "repo": "x/y"}},
     "model.net._target_ torch.hub.load is neither"),
    ({"_target_": "csframework.models.Supervised", "net": {"_target_": "fixtures.mlp", "_partial_": True}},
     "model.net._partial_ is refused"),
    ({"_target_": "csframework.models.Supervised", "net": "${oc.env:HOME}"}, "model.net holds an interpolation"),
])
def test_load_model_refuses_a_config_that_names_anything_but_classes(trained, tmp_path, model_config, message):
    checkpoint = forged(trained, tmp_path, model_config)
    with pytest.raises(csf.DamagedCheckpoint, match=message):
        csf.load_model(checkpoint)
