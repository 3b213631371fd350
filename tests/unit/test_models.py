"""``csframework.models.Supervised``: a regression loss refuses a prediction whose shape is not its target's
(torch would broadcast ``(B, 1)`` against ``(B,)`` into a ``(B, B)`` loss), naming both shapes and the fix;
``squeeze=true`` fits a ``Linear(n, 1)`` to targets of shape ``(B,)``; ``preds`` is the prediction."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import csframework as csf
from csframework.models import Supervised
import fixtures


def regression_set(n: int = 64, dim: int = 4, seed: int = 0) -> TensorDataset:
    """``y = x @ w + noise``, targets of shape ``(n,)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, x @ torch.arange(1.0, dim + 1) + 0.1 * torch.randn(n, generator=g))


def test_a_column_against_a_vector_is_refused_naming_both_shapes_and_squeeze():
    model = Supervised(nn.Linear(4, 1), loss="mse")
    x, y = regression_set()[:8]
    with pytest.raises(csf.ModelError) as caught:
        model((x, y))
    message = str(caught.value)
    assert "[8, 1]" in message and "[8]" in message and "model.squeeze=true" in message
    assert "\n" not in message


@pytest.mark.parametrize("loss", ["mse", "l1"])
def test_squeeze_makes_the_loss_the_per_sample_one(loss):
    model = Supervised(nn.Linear(4, 1), loss=loss, squeeze=True)
    x, y = regression_set()[:8]
    out = model((x, y))
    expected = (nn.functional.mse_loss if loss == "mse" else nn.functional.l1_loss)(model.net(x)[:, 0], y)
    assert torch.equal(out["loss"], expected)
    assert out["preds"].shape == (8,) and not out["preds"].requires_grad


def test_other_mismatched_shapes_are_refused_too():
    model = Supervised(nn.Linear(4, 3), loss="mse")
    x, y = regression_set()[:8]
    with pytest.raises(csf.ModelError, match=r"\[8, 3\].*\[8\]"):
        model((x, y))


def test_a_batch_without_targets_gives_the_predictions():
    model = Supervised(nn.Linear(4, 1), loss="mse", squeeze=True)
    x, _ = regression_set()[:8]
    for batch in (x, [x]):
        out = model(batch)
        assert set(out) == {"logits", "preds"} and out["preds"].shape == (8,)


def test_classification_keeps_its_outputs():
    model = Supervised(fixtures.mlp())
    x, y = fixtures.tensor_blobs(n=8)[:]
    out = model((x, y))
    assert torch.equal(out["preds"], out["logits"].argmax(-1)) and "accuracy" in out


def test_a_run_with_a_broadcasting_regression_fails_at_its_first_step_with_one_line(tmp_path):
    cfg = fixtures.compose("model.loss=mse", "data.val=null")
    cfg.model = {"_target_": "csframework.models.Supervised", "loss": "mse",
                 "net": {"_target_": "torch.nn.Linear", "in_features": 4, "out_features": 1}}
    cfg.data.train = {"_target_": f"{__name__}.regression_set"}
    with pytest.raises(csf.ModelError, match="model.squeeze=true"):
        csf.Run(cfg, output_dir=tmp_path).fit()
    cfg.model["squeeze"] = True
    assert csf.Run(cfg, output_dir=tmp_path / "fixed").fit()["status"] == "completed"


# -- docs/guides/regression.md, as written ----------------------------------------------------------------
PAGE = "docs/guides/regression.md"


def page_block(start: str) -> str:
    from doc_blocks import blocks

    return next(b.text for b in blocks(PAGE) if b.text.startswith(start))


def regression_10(n: int = 96, seed: int = 0) -> TensorDataset:
    """Ten features, as the page's ``Linear(10, 1)`` takes."""
    return regression_set(n=n, dim=10, seed=seed)


def test_the_page_s_error_line_is_the_run_s(tmp_path):
    from csframework.__main__ import error_lines

    shown = page_block("csframework: error: model.loss=mse").strip()
    model = Supervised(nn.Linear(10, 1), loss="mse")
    x, y = regression_10(n=32)[:]
    with pytest.raises(csf.ModelError) as caught:
        model((x, y))
    assert error_lines(caught.value) == [shown]


def test_the_page_s_model_file_trains_a_regression_with_its_metrics_plugin(tmp_path):
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "linear_regression.yaml").write_text(page_block("# conf/model/linear_regression.yaml"))
    plugin: dict = {}
    exec(page_block("import csframework as csf\n\n\nclass RegressionMetrics"), plugin)
    cfg = csf.compose(["model=linear_regression", "data=tiny_clusters", "loop.max_steps=6", "optimizer=sgd",
                       "optimizer.lr=0.05", "loop.collect=[preds,labels]", f"data.train={{_target_: {__name__}.regression_10}}",
                       f"data.val={{_target_: {__name__}.regression_10, n: 40, seed: 1}}"],
                      config_dir=str(tmp_path / "conf"))
    run = csf.Run(cfg, plugins=[plugin["RegressionMetrics"]()], output_dir=tmp_path / "run")
    metrics = run.fit()["metrics"]
    x, y = regression_10(n=40, seed=1)[:]
    with torch.no_grad():
        preds = run.model.net(x)[:, 0]
    r2 = 1 - float(((y - preds) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    assert metrics["val/r2"] == pytest.approx(r2, rel=1e-5)
    assert metrics["val/mae"] == pytest.approx(float((preds - y).abs().mean()), rel=1e-5)
    assert metrics["val/loss"] == pytest.approx(float(((preds - y) ** 2).mean()), rel=1e-5)
