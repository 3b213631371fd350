"""``csframework.collect``.

The output collector (``loop.collect``, issue 13 item 1) in one process; across ranks see
e2e/test_distributed.py, the example's use of it e2e/test_collect_example.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import csframework as csf
import fixtures
from csframework.data import ResumableSampler
from csframework.errors import ConfigError, ValidationError


class Keep:
    """Keeps a copy of ``run.eval_outputs`` of every evaluation (and whether they were memory-mapped)."""

    def __init__(self):
        self.seen: list[dict] = []
        self.run = None

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        self.run = run
        self.seen.append({k: v.clone() for k, v in run.eval_outputs.items()})


class Features(nn.Module):
    """A classifier that also returns a wide feature row per sample (4 KiB), to make collection big."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.inner = csf.models.Supervised(fixtures.mlp())
        self.width = width

    def forward(self, batch):
        out = self.inner(batch)
        out["features"] = out["logits"].detach().repeat(1, self.width // 4)
        return out


def fit(tmp_path, *overrides, plugins=()):
    keep = Keep()
    summary = csf.Run(fixtures.compose(*overrides), plugins=[keep, *plugins], output_dir=tmp_path).fit()
    return keep, summary


def collected_events(run_dir):
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == "eval_outputs_collected"]


def test_every_sample_once_in_dataset_order_after_each_evaluation(tmp_path):
    keep, _ = fit(tmp_path, "loop.collect=[preds,labels,logits]", "data.val.n=61", "data.eval_batch_size=5",
                  "loop.eval_every=4")
    assert len(keep.seen) == 2  # at step 4 and step 8
    labels = fixtures.Blobs(61, seed=1).y
    for outputs in keep.seen:
        assert torch.equal(outputs["labels"], labels)
        assert outputs["logits"].shape == (61, 4)
        assert torch.equal(outputs["preds"], outputs["logits"].argmax(-1))
    assert keep.run.eval_outputs == {}  # only during on_eval_end


def test_whole_set_accuracy_from_collected_outputs_matches_the_batch_means_on_equal_batches(tmp_path):
    keep, summary = fit(tmp_path, "loop.collect=[preds,labels]", "data.eval_batch_size=16")
    outputs = keep.seen[-1]
    accuracy = float((outputs["preds"] == outputs["labels"]).float().mean())
    assert accuracy == pytest.approx(summary["metrics"]["val/accuracy"])


def test_past_the_memory_bound_it_spills_to_files_with_the_same_result_and_removes_them(tmp_path):
    common = ["model._target_=test_collect.Features", "~model.net", "~model.loss",
              "loop.collect=[features,labels]", "data.eval_batch_size=8", "data.val.n=400"]
    kept, _ = fit(tmp_path / "memory", *common)
    spilled, _ = fit(tmp_path / "spilled", *common, "loop.collect_max_memory_mb=0.1")
    for key in ("features", "labels"):
        assert torch.equal(kept.seen[-1][key], spilled.seen[-1][key])
    in_memory, = collected_events(tmp_path / "memory")
    bounded, = collected_events(tmp_path / "spilled")
    assert not in_memory["spilled"] and bounded["spilled"]
    total_mb = 400 * (1024 * 4 + 8) / 2**20  # 1.6 MB collected
    assert in_memory["peak_mb"] >= total_mb
    assert bounded["peak_mb"] <= 0.1 + 8 * (1024 * 4 + 8) / 2**20  # the bound and at most one batch more
    assert not list((tmp_path / "spilled").glob(".collect-*"))


def test_collect_save_writes_safetensors_per_evaluation_step(tmp_path):
    keep, _ = fit(tmp_path, "loop.collect=[preds,labels]", "loop.collect_save=true", "loop.eval_every=4")
    saved = sorted(p.name for p in (tmp_path / "eval_outputs").iterdir())
    assert saved == ["step_4.safetensors", "step_8.safetensors"]
    last = load_file(tmp_path / "eval_outputs" / "step_8.safetensors")
    assert last.keys() == {"preds", "labels"}
    assert torch.equal(last["labels"], keep.seen[-1]["labels"])


def test_a_key_the_model_does_not_return_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"loop.collect: the model's evaluation outputs have no 'probs' "
                                          r"\(it returns accuracy, labels, logits, loss, preds\)"):
        fit(tmp_path, "loop.collect=[preds,probs]")
    with pytest.raises(ConfigError, match="loop.collect: output 'accuracy' is a scalar tensor"):
        fit(tmp_path / "scalar", "loop.collect=[accuracy]")
    assert not list(tmp_path.glob(".collect-*"))


class PerBatch(nn.Module):
    """A classifier that also returns one row per class for the whole batch (not one per sample)."""

    def __init__(self):
        super().__init__()
        self.inner = csf.models.Supervised(fixtures.mlp())

    def forward(self, batch):
        out = self.inner(batch)
        out["class_counts"] = torch.bincount(out["preds"], minlength=4)
        return out


def test_an_output_without_one_row_per_sample_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"loop.collect: output 'class_counts' has 4 rows for a batch of 16 "
                                          r"samples; only outputs with one row per sample can be collected"):
        fit(tmp_path, "loop.collect=[preds,class_counts]", f"model._target_={__name__}.PerBatch", "~model.net",
            "~model.loss")
    assert not list(tmp_path.glob(".collect-*"))


@pytest.mark.parametrize("overrides, problem", [
    (["loop.collect_max_memory_mb=0"], "loop.collect_max_memory_mb: 0.0 must be in (0, 1048576]"),
    (["loop.collect=[preds]", "data.val=null"], "loop.collect: it collects evaluation outputs, and this run has no data.val"),
    (["loop.collect_save=true"], "loop.collect_save: there is nothing to save"),
    (["loop.collect=[preds,preds]"], "loop.collect: ['preds', 'preds'] names a key twice"),
])
def test_bad_collect_settings_are_refused_before_anything_is_built(overrides, problem):
    with pytest.raises(ValidationError) as info:
        csf.Run(fixtures.compose(*overrides))
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


def test_evaluation_shards_are_padded_so_every_sample_is_seen_in_interleaved_order():
    shards = [list(ResumableSampler(61, False, 0, rank, 2, pad=True)) for rank in range(2)]
    assert len(shards[0]) == len(shards[1]) == 31  # equal, so every rank runs the same batches
    interleaved = [i for pair in zip(*shards) for i in pair]
    assert interleaved[:61] == list(range(61)) and interleaved[61:] == [0]  # the padding is the tail
    assert len(ResumableSampler(61, False, 0, 1, 2)) == 30  # training still drops the remainder

