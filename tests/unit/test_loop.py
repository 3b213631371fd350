"""``csframework.loop``: the step boundary (``on_train_step_end`` once per optimizer step), evaluation, log
windows, and where a resumed run picks up.

Evaluation (``loop.evaluate``): the batches run under ``torch.inference_mode()``, or ``torch.no_grad()``
with ``loop.inference_mode=false``; the ``val/*`` means are the same either way, and the same as a
hand-written loop's; a model that needs autograd in evaluation has its escape hatch.

A resumed run trains as the uninterrupted one where its checkpoint sits on a boundary: at the end of a
stage (after its final evaluation), after a stop request's final evaluation, at the end of a stage that
ended inside a gradient-accumulation step. Evaluation never changes training: it draws from generators of
its own. (Mid-epoch and end-of-epoch positions: ``test_batched``.)

No value is read from the device inside a step (the accelerator's path taken on the CPU: the loss made to
look like a device's): the finite check, the metric sums and the loss scaler's overflow check wait for the
next log, evaluation or checkpoint, which a non-finite loss then stops, naming its step."""
from __future__ import annotations

import json
import math
import sys

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
    from csframework.batched import samples_in

    x = torch.zeros(5, 3)
    assert samples_in([x, torch.zeros(5)]) == 5
    assert samples_in({"names": ["a"] * 5, "x": x}) == 5  # strings first: the val means still weigh 5 samples
    assert samples_in(["a", "b"]) is None and samples_in(torch.tensor(1.0)) is None


# -- resume boundaries --------------------------------------------------------------------------------------

#: Random validation data (augmentations drawn in process) and dropout: an evaluation that drew from the
#: training generators would change the training that follows it.
RANDOM = ["data.train._target_=fixtures.tensor_blobs", "data.val._target_=fixtures.AugmentedBlobs",
          "+model.net.dropout=0.2"]


class Record:
    """Every training loss, and each evaluation's (stage, step, metrics)."""

    name = "record"

    def __init__(self):
        self.losses, self.evals = [], []

    @csf.hookimpl
    def on_train_batch_end(self, outputs):
        self.losses.append(float(outputs["loss"]))

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        self.evals.append((run.stage, run.global_step, dict(metrics)))


class StopAt:
    name = "stop_at"

    def __init__(self, step: int):
        self.step = step

    @csf.hookimpl
    def on_train_batch_end(self, run):
        if run.global_step == self.step:
            run.request_stop("enough")


def fit(output_dir, *overrides, plugins=()) -> tuple[Record, dict]:
    record = Record()
    run = csf.Run(fixtures.compose(*overrides), output_dir=output_dir, plugins=[record, *plugins])
    assert run.fit()["status"] == "completed"
    return record, {k: v.clone() for k, v in run.model.state_dict().items()}


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_evaluating_more_often_does_not_change_training(tmp_path):
    rarely, rarely_params = fit(tmp_path / "rarely", *RANDOM, "loop.max_steps=24", "loop.eval_every=null")
    often, often_params = fit(tmp_path / "often", *RANDOM, "loop.max_steps=24", "loop.eval_every=4")
    assert len(often.evals) == 6 and len(rarely.evals) == 1
    assert often.losses == rarely.losses
    assert_same_params(often_params, rarely_params)
    assert often.evals[-1][2] == rarely.evals[-1][2], "the evaluation of a step is the same in every run"


def test_a_run_resumed_at_the_end_of_a_stage_neither_evaluates_it_again_nor_trains_differently(tmp_path):
    stages = [*RANDOM, "+stages.warm.loop.max_steps=16", "+stages.main.loop.max_steps=6"]
    straight, straight_params = fit(tmp_path / "straight", *stages)
    # the default checkpointing: one checkpoint at each stage's end, after its final evaluation
    resumed, resumed_params = fit(tmp_path / "resumed", *stages,
                                  f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000016'}")
    assert [e[:2] for e in straight.evals] == [("warm", 16), ("main", 22)]
    assert [e[:2] for e in resumed.evals] == [("main", 22)]
    assert resumed.losses == straight.losses[16:]
    assert resumed.evals[-1] == straight.evals[-1]
    assert_same_params(straight_params, resumed_params)


def test_a_run_stopped_by_request_stop_and_resumed_trains_as_one_that_went_on(tmp_path):
    straight, straight_params = fit(tmp_path / "straight", *RANDOM, "loop.max_steps=20")
    fit(tmp_path / "run", *RANDOM, "loop.max_steps=16", plugins=[StopAt(12)])  # evaluates, then saves step 12
    resumed, resumed_params = fit(tmp_path / "run", *RANDOM, "loop.max_steps=20", "checkpoint.resume=auto")
    assert resumed.losses == straight.losses[12:]
    assert_same_params(straight_params, resumed_params)


def test_a_stage_that_ends_inside_an_accumulated_step_drops_its_gradients(tmp_path):
    # 256 samples in batches of 16, 3 micro-batches a step: one epoch is 5 steps and 1 micro-batch left over
    stages = ["data.train._target_=fixtures.tensor_blobs", "optimizer=sgd", "optimizer.lr=0.1",
              "+stages.warm.loop.max_epochs=1", "+stages.warm.loop.max_steps=null",
              "+stages.warm.loop.grad_accum_steps=3", "+stages.main.loop.max_steps=4"]
    straight, straight_params = fit(tmp_path / "straight", *stages)
    resumed, resumed_params = fit(tmp_path / "resumed", *stages,
                                  f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000005'}")
    assert len(straight.losses) == 16 + 4
    assert resumed.losses == straight.losses[16:], "the next stage starts without the left-over gradients"
    assert_same_params(straight_params, resumed_params)
    events = [json.loads(line) for line in (tmp_path / "straight" / "events.jsonl").read_text().splitlines()]
    dropped = [e for e in events if e["event"] == "partial_step_dropped"]
    assert len(dropped) == 1 and dropped[0]["level"] == "warning" and dropped[0]["stage"] == "warm"
    assert dropped[0]["micro_batches"] == 1 and dropped[0]["grad_accum_steps"] == 3
    assert "loop.grad_accum_steps" in dropped[0]["problem"]


# -- the last step: its evaluation before its checkpoint ------------------------------------------------------
def checkpoint_meta(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text())


def assert_last_checkpoint_holds_the_final_evaluation(run_dir, summary: dict, step: int) -> None:
    """The checkpoint of the last step holds the final evaluation's metrics and is the best kept."""
    final = summary["metrics"]["val/loss"]
    assert checkpoint_meta(run_dir, step)["metrics"].get("val/loss") == final
    assert summary["best_checkpoint"] == {"path": f"checkpoints/step-{step:08d}", "metric": "val/loss",
                                          "value": final}


def test_the_last_step_of_a_stage_of_epochs_evaluates_before_its_checkpoint(tmp_path):
    # 256 samples in batches of 16, 3 micro-batches a step: 2 epochs are 10 steps and 2 micro-batches left
    # over; every_steps=5 saves the last step, whose final evaluation used to come after the stage's end
    recorder = fixtures.Recorder()
    run, summary = fixtures.fit(tmp_path, "loop.max_steps=null", "loop.max_epochs=2", "loop.grad_accum_steps=3",
                                "checkpoint.every_steps=5", "checkpoint.keep_best.monitor=val/loss",
                                plugins=[recorder])
    assert summary["global_step"] == 10
    assert_last_checkpoint_holds_the_final_evaluation(tmp_path, summary, 10)
    at_10 = [name for name, step in recorder.calls if step == 10 and name in ("on_eval_end", "on_checkpoint_save")]
    assert at_10 == ["on_eval_end", "on_checkpoint_save"]
    assert "checkpoint_saved" in [e["event"] for e in fixtures.events(tmp_path)]


class StopAfterEvaluationPoint:
    """Requests a stop at step ``step`` from ``on_train_step_end``: after that step's evaluation point."""

    name = "stop_late"

    def __init__(self, step: int):
        self.step = step

    @csf.hookimpl
    def on_train_step_end(self, run, step):
        if step == self.step:
            run.request_stop("late")


def test_a_stop_requested_after_the_step_s_evaluation_still_checkpoints_the_final_one(tmp_path):
    run, summary = fixtures.fit(tmp_path, "loop.max_steps=20", "checkpoint.every_steps=4",
                                "checkpoint.keep_best.monitor=val/loss", plugins=[StopAfterEvaluationPoint(8)])
    assert summary["global_step"] == 8 and summary["stop_reason"] == "late"
    assert_last_checkpoint_holds_the_final_evaluation(tmp_path, summary, 8)


def test_a_run_resumed_at_its_end_trains_and_writes_nothing(tmp_path):
    _, first = fixtures.fit(tmp_path, "loop.max_steps=6", "checkpoint.every_steps=3")
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")}
    summary_text = (tmp_path / "summary.json").read_text()
    recorder = fixtures.Recorder()
    run, again = fixtures.fit(tmp_path, "loop.max_steps=6", "checkpoint.every_steps=3", "checkpoint.resume=auto",
                              plugins=[recorder])
    assert run.already_complete and again["status"] == "completed" and again["global_step"] == 6
    assert [name for name, _ in recorder.calls] == ["on_checkpoint_load", "on_fit_start", "on_fit_end"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")} == written
    assert (tmp_path / "summary.json").read_text() == summary_text  # its wall time and figures stay
    assert fixtures.events(tmp_path)[-2]["event"] == "already_complete"
    assert first["metrics"] == again["metrics"]


# -- log windows --------------------------------------------------------------------------------------------
def test_logged_means_are_float32_means_of_device_windows_and_exact_means_of_host_numbers():
    """``loop.window_means``: the mean of each output since the last log: of tensors kept on a device, their
    float32 mean, the same whether stacked together (a value at every step) or reduced one by one (an output
    some steps lack), whatever their dtypes; of numbers read on the host, the exact mean (rounded once), NaN
    where one is not finite."""
    from csframework.loop import window_means

    g = torch.Generator().manual_seed(0)
    loss = list(torch.rand(7, generator=g) * 3)
    accuracy = list(torch.rand(7, generator=g).to(torch.bfloat16))
    count = list(torch.randint(0, 9, (7,), generator=g))
    expected = [float(torch.stack(w).float().mean()) for w in (loss, accuracy, count)]
    assert window_means([loss, accuracy, count]) == expected
    assert window_means([loss, accuracy[:3], count]) == [expected[0], float(torch.stack(accuracy[:3]).float().mean()),
                                                          expected[2]]
    host = [0.1, 0.2, 0.3, 1e16, -1e16]  # a float sum loses the small ones; the exact mean does not
    assert window_means([host, [1, 2], [True, False, False, False]]) == [0.6 / 5, 1.5, 0.25]
    assert [math.isnan(m) for m in window_means([[1.0, math.inf, -math.inf], [math.nan, 1.0], [2.0]])] == \
        [True, True, False]
    with pytest.warns(UserWarning, match="imaginary part"):  # a complex output: its real part, as torch casts
        assert window_means([[1.0, 2.0], [1 + 2j, 3 - 1j]]) == [1.5, 2.0]


# -- the step boundary --------------------------------------------------------------------------------------
def test_on_train_step_end_fires_once_per_optimizer_step_after_its_batches(tmp_path):
    import csframework as csf
    import fixtures

    calls = []

    class Steps:
        name = "steps"

        @csf.hookimpl
        def on_train_batch_end(self, run, batch_idx, outputs):
            calls.append(("batch", batch_idx, run.global_step))
            in_graph.extend(v.requires_grad for v in outputs.values() if isinstance(v, torch.Tensor))

        @csf.hookimpl
        def on_train_step_end(self, run, step, outputs):
            calls.append(("step", step, float(outputs["loss"]) > 0))
            in_graph.extend(v.requires_grad for v in outputs.values() if isinstance(v, torch.Tensor))

    in_graph: list[bool] = []  # the backend returns the outputs as the model made them: the loop detaches them
    csf.Run(fixtures.compose("loop.max_steps=2", "loop.grad_accum_steps=3"), plugins=[Steps()],
            output_dir=tmp_path).fit()
    assert calls == [("batch", 0, 0), ("batch", 1, 0), ("batch", 2, 1), ("step", 1, True),
                     ("batch", 3, 1), ("batch", 4, 1), ("batch", 5, 2), ("step", 2, True)]
    assert in_graph and not any(in_graph)


# -- no host synchronisation between boundaries ------------------------------------------------------------------
#: The ways a tensor's value reaches Python; on a GPU each waits for the device (a host synchronisation).
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class OnDevice(torch.Tensor):
    """An output that is not in host memory, as on a GPU: the loop then keeps it as an accelerator's (read at
    the boundaries), so a CPU run takes the GPU's path through the step."""

    @property
    def is_cpu(self) -> bool:
        return False


class LossOnDevice(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch):  # every output on the "device", as on a GPU (the loop reads host scalars as kept)
        return {k: v.as_subclass(OnDevice) if isinstance(v, torch.Tensor) else v for k, v in self.model(batch).items()}


class ReadsPerStep:
    """Counts, per optimizer step, every read of a tensor's value made from the step's first hook to its
    ``on_train_step_end``, by anyone (csframework, torch on its behalf, a plugin), with where it was made.
    Not counted: torch's optimizers reading their step counters (``_get_value``), which torch keeps in host
    memory on a GPU too (no synchronisation); the batch's fetch, from host memory, comes before the window."""

    name = "reads_per_step"

    def __init__(self, monkeypatch):
        self.reads: dict[int, list[str]] = {}
        self.step = None
        for method in READS:
            monkeypatch.setattr(torch.Tensor, method, self._counted(getattr(torch.Tensor, method), method))

    def _counted(self, read, method):
        def counted(tensor, *args, **kwargs):
            if self.step is not None:
                caller = sys._getframe(1)
                if caller.f_code.co_name != "_get_value":
                    where = f"{caller.f_code.co_filename.split('site-packages/')[-1]}:{caller.f_lineno}"
                    self.reads.setdefault(self.step, []).append(f"{method} at {where}")
            return read(tensor, *args, **kwargs)

        return counted

    @csf.hookimpl(tryfirst=True)
    def on_train_batch_start(self, run):
        self.step = run.global_step + 1

    @csf.hookimpl(trylast=True)
    def on_train_step_end(self):
        self.step = None


#: The embedded default transformer (smaller) and the tests' MLP, their losses on the "device"
TRANSFORMER = {"_target_": "csframework.defaults.TinyTransformer", "block_size": 16, "d_model": 32, "n_layers": 1,
               "n_heads": 2}
MLP = {"_target_": "csframework.models.Supervised", "net": {"_target_": "fixtures.mlp"}}


@pytest.mark.parametrize("case, overrides", [
    # the embedded default's step (AdamW, clipping, a cosine warm-up), every built-in plugin on
    pytest.param("default", ["model=tiny_transformer", "data=stdlib_text", "data.batch_size=4",
                             "data.train.num_chars=20000", "data.val.num_chars=20000", "data.train.block_size=16",
                             "data.val.block_size=16", "optimizer=adamw"], marks=pytest.mark.slow),
    ("bfloat16", ["precision=bfloat16", "optimizer=adamw", "loop.grad_accum_steps=2"]),
    # dynamic loss scaling: the overflow check and the skipped step stay on the device
    ("float16", ["precision=float16", "optimizer=adamw", "loop.grad_accum_steps=2"]),
    ("float16-sgd", ["precision=float16", "optimizer=sgd", "optimizer.momentum=0.9", "optimizer.max_grad_norm=1"]),
])
def test_no_tensor_is_read_between_the_boundaries_of_a_step(tmp_path, monkeypatch, case, overrides):
    """No host synchronisation in a step unless a plugin asks for a value: the losses' finite check, the
    metric sums and the loss scaler's overflow check wait for the next log, evaluation or checkpoint."""
    counter = ReadsPerStep(monkeypatch)
    cfg = fixtures.compose("loop.max_steps=13", "loop.log_every=4", "loop.eval_every=6", "loop.eval_steps=2",
                           "checkpoint.every_steps=5", *overrides)
    cfg.model = {"_target_": f"{__name__}.LossOnDevice", "model": TRANSFORMER if case == "default" else MLP}
    summary = csf.Run(cfg, plugins=[counter], output_dir=tmp_path).fit()
    assert summary["status"] == "completed"
    boundaries = {4, 5, 6, 8, 10, 12, 13}  # logs, evaluations, checkpoints; the last step logs and evaluates
    between = {step: reads for step, reads in counter.reads.items() if step not in boundaries}
    assert between == {}, f"{case}: values read inside steps: {between}"
    assert counter.reads, "the boundaries read the logged means: the counter sees reads"


@pytest.mark.parametrize("boundary, overrides, stops_at", [
    ("checkpoint", ["checkpoint.every_steps=2"], 4),
    ("log", ["loop.log_every=5"], 5),
    ("evaluation", ["loop.eval_every=4", "loop.eval_steps=1"], 4),
])
def test_a_nan_loss_on_an_accelerator_stops_the_run_at_the_next_boundary_naming_its_step(tmp_path, boundary,
                                                                                          overrides, stops_at):
    """A loss on the device is checked where the run synchronises anyway: the next log, evaluation or
    checkpoint after the NaN of step 3. The error names step 3; no checkpoint or evaluation holds it."""
    cfg = fixtures.compose("loop.max_steps=50", "loop.log_every=10", "checkpoint.keep_last=50", *overrides)
    cfg.model = {"_target_": f"{__name__}.LossOnDevice", "model": MLP}
    run = csf.Run(cfg, plugins=[fixtures.PoisonAt(3)], output_dir=tmp_path)
    with pytest.raises(csf.NonFiniteLossError, match="the loss is nan at step 3;"):
        run.fit()
    assert run.global_step == stops_at
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert saved == (["step-00000002"] if boundary == "checkpoint" else [])
    assert "val/loss" not in run.metrics, "the NaN weights were not evaluated"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "step 3" in summary["error"]
