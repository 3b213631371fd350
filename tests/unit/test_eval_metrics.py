"""Metrics from the config (``metrics:``, ``builtin/eval_metrics.py``) and ``run.report`` during an
evaluation joining its metrics (issue 49 item 7)."""
from __future__ import annotations

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import csframework as csf
import fixtures
from csframework.builtin.eval_metrics import real_rows
from csframework.errors import CsfError, ValidationError
from csframework.hookspecs import hookimpl


def regression(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.3 * torch.randn(n, generator=g))


class Regressor(nn.Module):
    """A linear regression model whose outputs are named as torchmetrics' ``update(preds, target)``."""

    def __init__(self, name: str = "preds"):
        super().__init__()
        self.net, self.name = nn.Linear(4, 1), name

    def forward(self, batch):
        x, y = batch
        preds = self.net(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(preds, y), self.name: preds, "target": y}


REGRESSION = ["model._target_=test_eval_metrics.Regressor", "~model.net", "~model.loss",
              "data.train._target_=test_eval_metrics.regression", "data.val._target_=test_eval_metrics.regression",
              "data.val.n=50", "data.val.seed=1", "~data.train.n", "optimizer=sgd", "optimizer.lr=0.05",
              "loop.max_steps=12", "loop.eval_every=6"]
MAE_R2 = ["+metrics.mae._target_=torchmetrics.MeanAbsoluteError", "+metrics.r2._target_=torchmetrics.R2Score"]


def run_dir_records(path):
    events = [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]
    summary = json.loads((path / "summary.json").read_text())
    return events, summary


def test_config_metrics_are_computed_over_the_whole_evaluation_set(tmp_path):
    pytest.importorskip("torchmetrics")
    run = csf.Run(fixtures.compose(*REGRESSION, *MAE_R2), output_dir=tmp_path)
    run.fit()
    x, y = regression(50, seed=1).tensors
    with torch.no_grad():
        preds = run.model.net(x).squeeze(-1)
    mae = float((preds - y).abs().mean())
    r2 = float(1 - ((preds - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    events, summary = run_dir_records(tmp_path)
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [6, 12]
    assert evals[-1]["val/mae"] == round(mae, 4) and "val/loss" in evals[-1], "one line with the set's metrics"
    assert summary["metrics"]["val/mae"] == pytest.approx(mae, rel=1e-5)
    assert summary["metrics"]["val/r2"] == pytest.approx(r2, rel=1e-4)


def test_a_value_reported_in_on_eval_end_is_in_that_evaluations_line(tmp_path):
    class Perplexity:
        name = "perplexity"

        @hookimpl
        def on_eval_end(self, run, metrics):
            run.report({"val/ppl": math.exp(metrics["val/loss"])})

    csf.Run(fixtures.compose(*REGRESSION, "loop.max_steps=2", "loop.eval_every=null"), output_dir=tmp_path,
            plugins=[Perplexity()]).fit()
    events, summary = run_dir_records(tmp_path)
    metrics = [e for e in events if e["event"] == "metrics" and "val/loss" in e]
    assert len(metrics) == 1 and metrics[0]["val/ppl"] == pytest.approx(math.exp(metrics[0]["val/loss"]))
    line = [e for e in events if e["event"] == "eval"]
    assert len(line) == 1 and "val/ppl" in line[0]
    assert not [e for e in events if e["event"] == "metrics" and set(e) >= {"val/ppl"} and "val/loss" not in e]


def test_the_outputs_a_metric_reads_are_named_by_its_inputs(tmp_path):
    pytest.importorskip("torchmetrics")
    common = [*REGRESSION, "loop.max_steps=2", "+model.name=estimate", MAE_R2[0]]
    with pytest.raises(CsfError, match=r"metrics.mae.inputs: the model's evaluation outputs have no 'preds' \(it "
                                          r"returns estimate, loss, target\); return it from forward, or name"):
        csf.Run(fixtures.compose(*common), output_dir=tmp_path / "default").fit()
    summary = csf.Run(fixtures.compose(*common, "+metrics.mae.inputs=[estimate,target]"),
                      output_dir=tmp_path / "named").fit()
    assert summary["metrics"]["val/mae"] > 0


def test_without_torchmetrics_a_metrics_entry_is_one_line_saying_how_to_install_it(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchmetrics"
                        else find_spec(name, *a))
    with pytest.raises(ValidationError) as e:
        csf.Run(fixtures.compose(*REGRESSION, MAE_R2[0], "mode=check"), output_dir=tmp_path)
    assert e.value.problems == ['metrics.mae: torchmetrics.MeanAbsoluteError needs torchmetrics, which is not '
                                'installed; pip install "csframework[metrics]"']


def test_a_metric_that_is_no_metric_is_refused_naming_its_key(tmp_path):
    with pytest.raises(ValidationError) as e:
        csf.Run(fixtures.compose(*REGRESSION, "+metrics.bad._target_=builtins.object", "mode=check"), output_dir=tmp_path)
    assert e.value.problems == ["metrics.bad: builtins.object built a object without update, compute, reset; give a "
                                "torchmetrics Metric (or an object with update, compute and reset)"]


@pytest.mark.parametrize("rank, rows", [(0, [2, 1, 0]), (1, [2, 0, 0])])
def test_under_ddp_a_ranks_padding_rows_are_left_out(rank, rows):
    # 5 samples over 2 ranks in batches of 2: rank 0 reads positions 0 2 | 4, rank 1 reads 1 3 | 5 (padding)
    loader = SimpleNamespace(position=SimpleNamespace(count=5), samples_per_batch=2)
    run = SimpleNamespace(eval_loaders={"val": loader}, eval_set="val", world_size=2, rank=rank)
    assert [real_rows(run, batch, 2) for batch in range(3)] == rows


def test_classification_metrics_read_supervised_outputs_and_list_states_compute_after_inference_mode(tmp_path):
    pytest.importorskip("torchmetrics")
    # Supervised returns preds and labels: the default inputs read labels for target; AUROC keeps every
    # batch's rows (list states, made under inference mode) until it computes
    summary = csf.Run(fixtures.compose(
        "loop.max_steps=4", "+metrics.acc._target_=torchmetrics.Accuracy", "+metrics.acc.task=multiclass",
        "+metrics.acc.num_classes=4", "+metrics.auc._target_=torchmetrics.AUROC", "+metrics.auc.task=multiclass",
        "+metrics.auc.num_classes=4", "+metrics.auc.inputs=[logits,labels]"), output_dir=tmp_path).fit()
    metrics = summary["metrics"]
    assert metrics["val/acc"] == pytest.approx(metrics["val/accuracy"], abs=1e-6)  # the batch means, equal batches
    assert 0.5 < metrics["val/auc"] <= 1.0


def test_every_metric_of_the_training_pages_example_builds():
    pytest.importorskip("torchmetrics")
    import yaml
    from doc_blocks import blocks

    from csframework.builtin.eval_metrics import build_metric

    block = next(b for b in blocks("docs/guides/training.md") if b.text.startswith("metrics:\n  mae:"))
    entries = yaml.safe_load(block.text)["metrics"]
    built = {name: build_metric(name, spec) for name, spec in entries.items()}
    assert {name: type(metric).__name__ for name, (metric, _) in built.items()} == {
        "mae": "MeanAbsoluteError", "r2": "R2Score", "auc": "MulticlassAUROC", "ppl": "Perplexity"}
    assert built["ppl"][1] == ["logits", "target"] and built["mae"][1] == ["preds", "target"]


@pytest.mark.parametrize("setting, problem", [
    ("plugins.disable=[eval_metrics]", "metrics: the eval_metrics plugin that computes them is disabled "
                                       "(plugins.disable); remove eval_metrics from plugins.disable, or remove metrics"),
    ("data.val=null", "metrics: they are computed over evaluation sets, and this run has none; set data.val (or "
                      "data.eval), or remove metrics"),
])
def test_metrics_that_nothing_would_compute_are_refused(tmp_path, setting, problem):
    with pytest.raises(ValidationError) as e:
        csf.Run(fixtures.compose(*REGRESSION, "+metrics.mean._target_=builtins.object", setting, "mode=check"),
                output_dir=tmp_path)
    assert problem in e.value.problems
