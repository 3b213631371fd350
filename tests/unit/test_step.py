"""``csframework.step``: the order of hooks and work of one optimizer step, written once."""
import contextlib

import pytest
import torch

from csframework import ModelError, step
from csframework.state import RunState


class Recorder:
    """Hooks and precision primitives that record what happens, in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):  # any hook
        return lambda **kwargs: self.calls.append(name)

    @contextlib.contextmanager
    def autocast(self):
        self.calls.append("autocast")
        yield

    def backward(self, loss):
        self.calls.append(f"backward {float(loss.detach()):g}")
        loss.backward()

    def unscale(self, optimizer):
        self.calls.append("unscale")
        return "overflow?"

    def optimizer_step(self, optimizer, skip):
        self.calls.append(f"optimizer_step {skip}")
        optimizer.step()

    def update(self):
        self.calls.append("update")


class FakeRun:
    def __init__(self):
        self.model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.ones_(self.model.weight)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.hooks = Recorder()
        self.state = RunState()  # its carried state: None (a stateless model)


def test_a_step_of_two_micro_batches_in_order():
    run = FakeRun()
    ops = run.hooks  # one recorder for hooks and primitives: one sequence
    module = lambda batch: {"loss": run.model(batch).sum(), "n": 1}  # noqa: E731
    batch = torch.ones(1, 2)
    outputs = step.train_step(run, ops, module, [batch, batch], max_grad_norm=0.5)
    assert ops.calls == ["autocast", "on_before_backward", "backward 1", "on_after_backward",
                         "autocast", "on_before_backward", "backward 1", "on_after_backward",
                         "unscale", "on_before_optimizer_step", "optimizer_step overflow?", "update"]
    assert not outputs["loss"].requires_grad and outputs["n"] == 1
    assert run.model.weight.grad is None  # zero_grad(set_to_none=True)
    # the accumulated gradient [2, 2] was clipped to norm 0.5 before the SGD step
    assert torch.allclose(run.model.weight, torch.full((1, 2), 1 - 0.1 * 0.5 / 2 ** 0.5))


def test_the_model_contract():
    assert step.model_outputs(torch.tensor(1.0)).keys() == {"loss"}
    # issue 39 item 1: a dict without 'loss' ({'los': ...}) is a ModelError (exit 2) naming the keys it had
    with pytest.raises(ModelError) as e:
        step.model_outputs({"los": torch.tensor(1.0), "logits": 1})
    assert e.value.exit_code == 2
    assert str(e.value).startswith("model.forward: forward(batch) returned a dict without a 'loss' key (its keys: "
                                   "'los', 'logits'); return the loss tensor or a dict with a 'loss' key")
    with pytest.raises(ModelError, match="returned a tuple; return the loss tensor"):
        step.model_outputs((torch.tensor(1.0),))


@pytest.mark.parametrize("loss, problem", [
    (lambda w: w * 2, "a loss of shape [3], dtype float32, not a scalar; a loss per sample: reduce it to one "
                      "number (e.g. loss.mean()); the model's predictions: return the loss computed from them"),
    (lambda w: (w * 2).sum().long(), "a loss of shape [], dtype int64, not a floating-point number"),
    (lambda w: (w * 2).sum().detach(), "a loss of shape [], dtype float32 that does not require grad"),
    (lambda w: 3.0, "a loss of type float, not a tensor"),
], ids=["vector", "integer", "detached", "number"])
def test_a_loss_that_cannot_be_trained_on_names_model_forward_and_what_it_returned(loss, problem):
    run, weight = FakeRun(), torch.ones(3, requires_grad=True)
    with pytest.raises(ModelError) as caught:
        step.micro_batch(run, run.hooks, lambda batch: {"loss": loss(weight)}, None, accum=2)
    model = "torch.nn.modules.linear.Linear"
    assert str(caught.value).startswith(f"model.forward: {model}.forward(batch) returned {problem}")
    assert caught.value.exit_code == 2


def test_a_one_element_loss_trains_as_a_scalar_one():
    run, weight = FakeRun(), torch.ones(3, requires_grad=True)
    step.micro_batch(run, run.hooks, lambda batch: {"loss": (weight * 2).sum().reshape(1)}, None, accum=1)
    assert torch.equal(weight.grad, torch.full((3,), 2.0))


def test_outputs_reach_hooks_out_of_the_graph_and_the_rest_as_the_model_made_them():
    weight = torch.ones(3, requires_grad=True)
    labels = torch.arange(3)
    logits = weight * 2
    outputs = step.detached({"loss": logits.sum(), "logits": logits, "labels": labels, "note": "text"})
    assert not any(v.requires_grad for v in outputs.values() if isinstance(v, torch.Tensor))
    assert torch.equal(outputs["logits"], logits) and outputs["loss"].item() == 6.0
    assert outputs["labels"] is labels and outputs["note"] == "text"  # in no graph: nothing to detach
    outputs["logits"].add_(1)  # a detached tensor shares the output's storage, as detach() does
    assert logits[0].item() == 3.0


def test_float32_is_a_null_policy_doing_only_the_plain_thing():
    """float32 takes the same path as every policy (one step sequence); its primitives add nothing: the
    update is the mean of the two micro-batches' gradients, one plain SGD step, no autocast."""
    from csframework.precision import FLOAT32, policy
    from csframework.config import PrecisionConfig

    assert policy(PrecisionConfig(), "cpu") is FLOAT32
    run = FakeRun()
    module = lambda batch: {"loss": run.model(batch).sum(), "autocast": torch.is_autocast_enabled()}  # noqa: E731
    batch = torch.ones(1, 2)
    outputs = step.train_step(run, FLOAT32, module, [batch, batch], max_grad_norm=None)
    assert run.hooks.calls == ["on_before_backward", "on_after_backward"] * 2 + ["on_before_optimizer_step"]
    assert outputs["autocast"] is False
    assert torch.allclose(run.model.weight, torch.full((1, 2), 1 - 0.1))
    assert run.model.weight.grad is None


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_the_float32_step_of_one_micro_batch_is_the_general_sequence_without_its_no_op_calls(max_grad_norm):
    """``step.plain_step`` (what ``EagerRunner`` runs for float32, one micro-batch a step, one process) calls
    the same hooks in the same order and computes the very same update and outputs as ``micro_batch`` then
    ``apply_gradients`` under ``FLOAT32``."""
    from csframework.precision import FLOAT32

    results = []
    for plain in (True, False):
        run = FakeRun()
        module = lambda batch: {"loss": run.model(batch).pow(2).sum(), "n": 1}  # noqa: E731
        batch = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
        for _ in range(3):
            if plain:
                outputs = step.plain_step(run, module, batch, max_grad_norm)
            else:
                outputs = step.micro_batch(run, FLOAT32, module, batch, 1)
                step.apply_gradients(run, FLOAT32, max_grad_norm)
        results.append((run.hooks.calls, run.model.weight.detach().clone(), run.model.weight.grad, outputs["n"],
                         outputs["loss"].detach()))
    (calls, weight, grad, n, loss), (calls2, weight2, grad2, n2, loss2) = results
    assert calls == calls2 == ["on_before_backward", "on_after_backward", "on_before_optimizer_step"] * 3
    assert torch.equal(weight, weight2) and grad is grad2 is None and n == n2 == 1 and torch.equal(loss, loss2)


def test_the_eager_runner_takes_the_float32_sequence_only_where_it_is_the_same_step():
    """Float32 with one micro-batch in one process: ``plain_step``; accumulation, a loss-scaling policy, DDP,
    FSDP and a subclass replacing primitives (the compiled update): the general sequence."""
    from csframework.backends.eager_step import EagerRunner
    from csframework.precision import FLOAT32

    module = torch.nn.Linear(2, 1)
    assert EagerRunner(FLOAT32, module).train_batch.__func__ is EagerRunner._plain
    for runner in (EagerRunner(FLOAT32, module, accum=2), EagerRunner(FLOAT32, module, distributed=True),
                   EagerRunner(FLOAT32, module, sharded=True), EagerRunner(Recorder(), module),
                   type("Subclass", (EagerRunner,), {})(FLOAT32, module)):
        assert runner.train_batch.__func__ is EagerRunner.train_batch


class FloatModel(torch.nn.Module):
    """A user's regression model: float inputs of 64 features."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 1)

    def forward(self, batch):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.linear(inputs).squeeze(-1), targets[:, 0])


def test_a_float_model_on_the_default_token_data_is_refused_naming_the_data_setting(tmp_path):
    """Issue 50 item 6: the docs' primary-config recipe (an own float model, the default data) failed at step 1
    with torch's ``mat1 and mat2 must have the same dtype, but got Long and Float``; now refused, before any
    update, naming the data setting to change."""
    import csframework as csf
    import fixtures

    cfg = fixtures.compose(f"model={{_target_:{__name__}.FloatModel}}", "~model.net", "~model.loss",
                           "data=stdlib_text", "data.train.num_chars=20000", "data.val.num_chars=20000",
                           "loop.max_steps=2")
    run = csf.Run(cfg, output_dir=tmp_path)
    before = [p.detach().clone() for p in run.model.parameters()]
    with pytest.raises(ModelError) as e:
        run.fit()
    assert str(e.value).startswith(f"model.forward: {__name__}.FloatModel.forward(batch) got integer inputs "
                                   "(int64 [32, 64] from data.train, csframework.defaults.StdlibText: token ids)")
    assert "Long and Float" in str(e.value) and "data=<yours>" in str(e.value) and "data=stdlib_text" in str(e.value)
    assert e.value.exit_code == 2
    assert all(torch.equal(a, b) for a, b in zip(before, run.model.parameters()))


class TakesInputsAndTargets(torch.nn.Module):
    """A newcomer's signature: forward(x, y) where csframework passes the batch whole."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.linear(x), y)


def doubles(n: int = 64):
    """A dataset as NumPy makes it: float64 inputs."""
    import fixtures

    blobs = fixtures.Blobs(n=n)
    return torch.utils.data.TensorDataset(blobs.x.double(), blobs.y)


@pytest.mark.parametrize("overrides, says", [
    ([f"model={{_target_:{__name__}.TakesInputsAndTargets}}"],
     f"model.forward: {__name__}.TakesInputsAndTargets: TakesInputsAndTargets.forward() missing 1 required positional "
     "argument: 'y'; csframework calls forward(batch) with the batch whole, as data.train gives it (a list of 2 here): "
     "take it and unpack it inside, e.g. def forward(self, batch): x, y = batch"),
    ([f"data.train._target_={__name__}.doubles", "~data.train.n"],
     "model.forward: csframework.models.Supervised.forward(batch) got float64 inputs ([16, 8] from data.train, "
     f"{__name__}.doubles) and computes in float32 ("),
], ids=["forward-x-y", "float64-data"])
def test_a_newcomer_s_model_or_data_mismatch_is_one_error_naming_the_fix(tmp_path, overrides, says):
    """They failed at step 1 with torch's TypeError or dtype error (exit 1) naming neither the data nor how
    csframework calls forward; now a ModelError (exit 2) says which."""
    import csframework as csf
    import fixtures

    cfg = fixtures.compose(*overrides, *(["~model.net", "~model.loss"] if "model=" in overrides[0] else []),
                           "loop.max_steps=2")
    with pytest.raises(ModelError) as e:
        csf.Run(cfg, output_dir=tmp_path).fit()
    assert str(e.value).startswith(says) and e.value.exit_code == 2, str(e.value)
