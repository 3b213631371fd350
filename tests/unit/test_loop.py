"""Evaluation (``loop.evaluate``): the batches run under ``torch.inference_mode()``, or ``torch.no_grad()``
with ``loop.inference_mode=false``; the ``val/*`` means are the same either way, and the same as a
hand-written loop's; a model that needs autograd in evaluation has its escape hatch."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import csframework as csf
import fixtures


def run_of(tmp_path, *overrides, plugins=(), model=None, data=None):
    cfg = fixtures.compose(*overrides)
    if model is not None:
        cfg.model = model
    if data is not None:
        cfg.data.train = cfg.data.val = data
    return csf.Run(cfg, plugins=list(plugins), output_dir=tmp_path)


def hand_written_means(run) -> dict[str, float]:
    """The ``val/*`` means as a hand-written loop computes them: per-sample means of every scalar output
    (each batch's value times its samples), summed in float32."""
    module = run.module
    module.eval()
    sums, count = {}, 0
    with torch.no_grad():
        for batch in run.val_loader:
            samples = len(batch[0])
            for key, value in module(batch).items():
                if value.ndim == 0:
                    sums[key] = sums[key] + value.float() * samples if key in sums else value.float() * samples
            count += samples
    return {f"val/{k}": float(v) / count for k, v in sums.items()}


@pytest.mark.parametrize("inference_mode", ["true", "false"])
def test_val_metrics_are_those_of_a_hand_written_loop(tmp_path, inference_mode):
    run = run_of(tmp_path, "loop.eval_every=4", "data.eval_batch_size=5", f"loop.inference_mode={inference_mode}")
    summary = run.fit()
    val = {k: v for k, v in summary["metrics"].items() if k.startswith("val/")}
    assert set(val) == {"val/loss", "val/accuracy"}
    assert len(run.val_loader.dataset) % 5 != 0, "a short last batch: it must weigh what it holds"
    assert val == pytest.approx(hand_written_means(run), rel=1e-6)  # the same float32 sums, same order


class SeesEvaluation:
    """Records the grad mode in the evaluation hooks, and keeps each batch's loss tensor and its value."""

    name = "sees_evaluation"

    def __init__(self):
        self.modes: list[tuple[bool, bool]] = []
        self.losses: list[tuple[torch.Tensor, float]] = []

    @csf.hookimpl
    def on_eval_batch_start(self, run):
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    @csf.hookimpl
    def on_eval_batch_end(self, outputs):
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        self.losses.append((outputs["loss"], float(outputs["loss"])))

    @csf.hookimpl
    def on_eval_end(self, metrics):
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))


@pytest.mark.parametrize("inference_mode, inside", [("true", (True, False)), ("false", (False, False))])
def test_batch_hooks_run_in_the_grad_mode_and_their_outputs_are_left_alone(tmp_path, inference_mode, inside):
    seen = SeesEvaluation()
    run = run_of(tmp_path, f"loop.inference_mode={inference_mode}", "data.eval_batch_size=16", plugins=[seen])
    summary = run.fit()
    assert seen.modes[:-1] == [inside] * 8  # 4 batches, 2 hooks each
    assert seen.modes[-1] == (False, True)  # on_eval_end: outside
    # the loop's sums are its own tensors: the outputs a hook kept still hold their values
    assert [float(t) for t, _ in seen.losses] == [v for _, v in seen.losses]
    assert summary["metrics"]["val/loss"] == pytest.approx(sum(v for _, v in seen.losses) / 4, rel=1e-6)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


class InputGradient(nn.Module):
    """A model whose outputs include the norm of the loss's gradient with respect to the inputs, which
    needs autograd in evaluation too (``torch.enable_grad()`` inside ``forward``)."""

    def __init__(self):
        super().__init__()
        self.net = fixtures.mlp()

    def forward(self, batch):
        x, y = batch
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            loss = nn.functional.cross_entropy(self.net(x), y)
            (grad,) = torch.autograd.grad(loss, x, create_graph=self.training)
        return {"loss": loss, "input_grad_norm": grad.norm()}


INPUT_GRADIENT = {"_target_": f"{__name__}.InputGradient"}


def test_a_model_that_needs_autograd_in_evaluation_runs_with_inference_mode_off(tmp_path):
    run = run_of(tmp_path, "loop.inference_mode=false", model=INPUT_GRADIENT)
    summary = run.fit()
    assert summary["metrics"]["val/input_grad_norm"] > 0
    assert summary["metrics"]["val/loss"] == pytest.approx(hand_written_means(run)["val/loss"], rel=1e-6)


def test_inference_mode_refuses_autograd_in_evaluation(tmp_path):
    # what loop.inference_mode=false is for: under inference_mode nothing can require grad
    with pytest.raises(RuntimeError, match="does not require grad|inference"):
        run_of(tmp_path, model=INPUT_GRADIENT).fit()


class CachingBlobs(Dataset):
    """``fixtures.Blobs`` whose samples are computed on first access and cached (one object for training
    and evaluation, see ``caching_blobs``)."""

    def __init__(self):
        self.blobs = fixtures.Blobs(64)
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, i):
        if i not in self.cache:
            x, y = self.blobs[i]
            self.cache[i] = (x * 1.0, y)  # a new tensor (not a view): made in whatever grad mode is on
        return self.cache[i]


_CACHING = None


def caching_blobs() -> CachingBlobs:
    global _CACHING
    _CACHING = _CACHING or CachingBlobs()
    return _CACHING


@pytest.mark.parametrize("inference_mode", ["true", "false"])
def test_samples_a_dataset_caches_during_evaluation_can_be_trained_on(tmp_path, inference_mode):
    # under inference_mode the cached samples are inference tensors; the collated batches are new tensors
    global _CACHING
    _CACHING = None
    run = run_of(tmp_path, f"loop.inference_mode={inference_mode}",
                 model={"_target_": "csframework.models.Supervised", "net": {"_target_": "fixtures.mlp"}},
                 data={"_target_": f"{__name__}.caching_blobs"})
    run.validate()
    made = {x.is_inference() for x, _ in _CACHING.cache.values()}
    assert len(_CACHING.cache) == 64 and made == {inference_mode == "true"}
    assert run.fit()["status"] == "completed"


class MixedDtypes(nn.Module):
    """Scalar outputs of several dtypes: a bfloat16 loss, an int64 count, a float64 score."""

    def __init__(self):
        super().__init__()
        self.net = fixtures.mlp()

    def forward(self, batch):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        return {"loss": loss if self.training else loss.bfloat16(), "count": torch.tensor(len(y)),
                "score": loss.double() * 3}


def test_val_means_of_other_dtypes_are_float32_sums_as_a_hand_written_loop(tmp_path):
    run = run_of(tmp_path, "loop.eval_every=4", "data.eval_batch_size=5",
                 model={"_target_": f"{__name__}.MixedDtypes"})
    val = {k: v for k, v in run.fit()["metrics"].items() if k.startswith("val/")}
    assert val == pytest.approx(hand_written_means(run), rel=1e-6)
    assert {k: type(v) for k, v in val.items()} == dict.fromkeys(("val/loss", "val/count", "val/score"), float)


class Rows(Dataset):
    """Sample ``i`` is the value ``i``: a batch's mean is the mean of its sample indices."""

    def __init__(self, n: int = 17):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class MeanOfRows(nn.Module):
    """``loss``: the batch's mean value; ``short``: 1, returned only by a batch of fewer than 16 samples."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, batch):
        out = {"loss": batch.mean() + 0 * self.w}
        if len(batch) < 16:
            out["short"] = torch.tensor(1.0)
        return out


def test_val_metrics_are_means_over_samples_whatever_the_batch_sizes(tmp_path):
    run = run_of(tmp_path, "loop.max_steps=1", "data.batch_size=16", "data.eval_batch_size=16",
                 model={"_target_": f"{__name__}.MeanOfRows"}, data={"_target_": f"{__name__}.Rows", "n": 17})
    val = {k: v for k, v in run.fit()["metrics"].items() if k.startswith("val/")}
    # batches of 16 and 1 samples: the mean of 0..16 is 8 (the mean of the two batch means would be 11.75)
    assert val["val/loss"] == pytest.approx(8.0)
    assert val["val/short"] == 1.0, "an output only some batches return is averaged over those batches"


def test_a_batch_counts_the_rows_of_its_first_tensor_whatever_comes_before_it():
    from csframework.loop import samples_in

    x = torch.zeros(5, 3)
    assert samples_in([x, torch.zeros(5)]) == 5
    assert samples_in({"names": ["a"] * 5, "x": x}) == 5  # strings first: the val means still weigh 5 samples
    assert samples_in(["a", "b"]) is None and samples_in(torch.tensor(1.0)) is None
