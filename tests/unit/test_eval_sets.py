"""Evaluation that estimates honestly (issue 40 item 2): ``loop.eval_steps=N`` reads N batches of samples
drawn over the whole set from ``seed`` (the same at every evaluation with ``data.eval_sample=fixed``, new
ones with ``fresh``); named evaluation sets (``data.eval``) with ``<name>/*`` metrics, ``data.val`` the
short form of ``val``; ``loop.eval_at_start``. The run is the tiny Blobs MLP of ``fixtures``."""
import pytest
import torch
from torch.utils.data import Dataset

import csframework as csf
import fixtures
from csframework.data import ResumableSampler
from csframework.errors import ValidationError


class Indexed(Dataset):
    """``n`` Blobs samples that carry their index, so a plugin sees which samples an evaluation read."""

    def __init__(self, n: int = 640, seed: int = 1):
        self.blobs = fixtures.Blobs(n=n, seed=seed)

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, i):
        x, y = self.blobs[i]
        return x, y, torch.tensor(i)


class IndexedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = fixtures.mlp()

    def forward(self, batch):
        return {"loss": torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])}  # (x, y[, index])


class SeenIndices:
    """The indices each evaluation read, per evaluation set: ``(step, set) -> sorted indices``."""

    name = "seen_indices"

    def __init__(self):
        self.seen: dict[tuple[int, str], list[int]] = {}

    @csf.hookimpl
    def on_eval_batch_end(self, run, batch, outputs, batch_idx):
        self.seen.setdefault((run.global_step, run.eval_set), []).extend(batch[2].tolist())


INDEXED = ["model._target_=test_eval_sets.IndexedModel", "~model.net", "~model.loss",
           "data.val._target_=test_eval_sets.Indexed", "data.val.n=640",
           "loop.eval_every=4", "loop.max_steps=8"]


def fit(tmp_path, *overrides):
    seen = SeenIndices()
    run = csf.Run(fixtures.compose(*INDEXED, *overrides), output_dir=tmp_path, plugins=[seen])
    return run, run.fit(), seen


# -- the sample ------------------------------------------------------------------------------------------
def test_a_sample_is_spread_over_the_whole_set_and_is_the_same_for_the_same_draw():
    sampler = ResumableSampler(1000, shuffle=False, seed=3, pad=True, sample=40)
    order = sampler.order().tolist()
    assert len(order) == len(set(order)) == 40 and order == sorted(order)
    assert min(order) < 200 and max(order) > 800  # not the first 40 samples: spread over the set
    assert sampler.order().tolist() == order
    sampler.set_epoch(7)
    assert sampler.order().tolist() != order
    # under two ranks each reads half of the same sample
    ranks = [ResumableSampler(1000, False, 3, rank=r, world_size=2, pad=True, sample=40) for r in (0, 1)]
    assert sorted(ranks[0].order().tolist() + ranks[1].order().tolist()) == order
    # a sample as large as the set is the set
    assert ResumableSampler(30, False, 3, pad=True, sample=40).order().tolist() == list(range(30))


def test_eval_steps_reads_the_same_sample_drawn_over_the_set_at_every_evaluation(tmp_path):
    _, summary, seen = fit(tmp_path, "loop.eval_steps=2")  # 2 batches of 16 of 640
    evaluations = [indices for (step, name), indices in sorted(seen.seen.items())]
    assert [step for step, _ in sorted(seen.seen)] == [4, 8] and len(evaluations[0]) == 32
    assert evaluations[0] == evaluations[1]
    assert max(evaluations[0]) > 320, "the sample reaches the second half of the set, not its first 32"
    assert summary["metrics"]["val/loss"] > 0


def test_fresh_draws_new_samples_at_each_evaluation(tmp_path):
    _, _, seen = fit(tmp_path, "loop.eval_steps=2", "data.eval_sample=fresh")
    first, second = (indices for _, indices in sorted(seen.seen.items()))
    assert len(first) == len(second) == 32 and first != second
    # and the draws are the run's: a second run reads the same ones (resume reads what the run would have)
    _, _, again = fit(tmp_path / "again", "loop.eval_steps=2", "data.eval_sample=fresh")
    assert again.seen == seen.seen


def test_without_eval_steps_every_sample_is_read(tmp_path):
    _, _, seen = fit(tmp_path, "loop.eval_every=null")
    assert seen.seen[(8, "val")] == list(range(640))


# -- named sets ------------------------------------------------------------------------------------------
def test_named_sets_are_evaluated_in_order_with_metrics_of_their_own(tmp_path):
    run, summary, seen = fit(tmp_path, "+data.eval.holdout._target_=test_eval_sets.Indexed",
                             "+data.eval.holdout.n=48", "+data.eval.holdout.seed=5")
    assert list(run.eval_loaders) == ["val", "holdout"]
    assert {"val/loss", "holdout/loss"} <= set(summary["metrics"])
    assert summary["metrics"]["val/loss"] != summary["metrics"]["holdout/loss"]
    assert seen.seen[(8, "holdout")] == list(range(48)) and seen.seen[(8, "val")] == list(range(640))
    csv = (tmp_path / "metrics.csv").read_text()
    assert csv.count(",holdout/loss,") == 2  # steps 4 and 8


def test_data_eval_alone_evaluates_without_data_val(tmp_path):
    run, summary, _ = fit(tmp_path, "data.val=null", "+data.eval.val._target_=test_eval_sets.Indexed",
                          "+data.eval.val.n=32")
    assert list(run.eval_loaders) == ["val"] and "val/loss" in summary["metrics"]


@pytest.mark.parametrize("overrides, problem", [
    (["+data.eval.train._target_=test_eval_sets.Indexed"], "data.eval.train: the metrics of a set are"),
    (["+data.eval.val._target_=test_eval_sets.Indexed"], "data.eval.val: data.val is set too"),
    (["+data.eval.holdout.n=3"], "data.eval.holdout: needs a _target_"),
])
def test_named_sets_that_cannot_work_are_refused(overrides, problem):
    with pytest.raises(ValidationError) as e:
        csf.Run(fixtures.compose(*INDEXED, *overrides))
    assert problem in str(e.value)


# -- evaluation at the start -----------------------------------------------------------------------------
def test_eval_at_start_evaluates_before_the_first_step_once(tmp_path):
    _, _, seen = fit(tmp_path, "loop.eval_at_start=true", "loop.eval_steps=1", "checkpoint.every_steps=4")
    assert sorted(step for step, _ in seen.seen) == [0, 4, 8]
    lines = [line for line in (tmp_path / "metrics.csv").read_text().splitlines() if ",val/loss," in line]
    assert lines[0].split(",")[0] == "0"
    # resumed later, it does not evaluate step 0 (or the resumed step) again
    _, _, resumed = fit(tmp_path, "loop.eval_at_start=true", "loop.eval_steps=1", "loop.max_steps=12",
                        "checkpoint.resume=auto")
    assert sorted(step for step, _ in resumed.seen) == [12]
