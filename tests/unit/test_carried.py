"""Carried state (``csframework.carried``): a model with ``initial_state`` gets ``forward(batch, state)``, its
state carried from batch to batch, detached, reset at each epoch and evaluation pass, and kept in
checkpoints; what cannot carry it is refused. And ``data.eval_sample=sequential``."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import csframework as csf
import fixtures
from csframework.errors import ModelError, ValidationError
from csframework.hookspecs import hookimpl


def token_stream(length: int = 161, streams: int = 4, vocab: int = 7, seed: int = 0) -> TensorDataset:
    """``streams`` parallel token streams (a batchified text, ``[length - 1, streams]``): sample ``t`` is
    token ``t`` of every stream and its next one, so batches of ``data.batch_size`` consecutive samples
    are word_language_model's ``get_batch``: ``[bptt, streams]``. Each token depends on the one three
    back, which only a state carried across batches remembers at a batch's start."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (length, streams), generator=g)
    for t in range(3, length):
        tokens[t] = (tokens[t - 3] + (torch.rand(streams, generator=g) < 0.1).long()) % vocab
    return TensorDataset(tokens[:-1], tokens[1:])


class CarryRNN(nn.Module):
    """A recurrent language model with the stateful contract; it records what each batch was given."""

    def __init__(self, vocab: int = 7, hidden: int = 8, wrong_return: bool = False, outputs: bool = False):
        super().__init__()
        self.embed, self.rnn, self.head = nn.Embedding(vocab, hidden), nn.RNN(hidden, hidden), nn.Linear(hidden, vocab)
        self.wrong_return, self.outputs = wrong_return, outputs
        self.fresh: torch.Tensor | None = None  # the latest initial state
        self.seen: list[tuple[str, bool]] = []  # per forward: "initial" or "carried", training

    def initial_state(self, batch):
        tokens, _ = batch
        self.fresh = torch.zeros(1, tokens.shape[1], self.rnn.hidden_size, device=tokens.device)
        return self.fresh

    def forward(self, batch, state):
        tokens, targets = batch
        assert not state.requires_grad, "the state a batch gets is detached"
        self.seen.append(("initial" if state is self.fresh else "carried", self.training))
        out, state = self.rnn(self.embed(tokens), state)
        logits = self.head(out)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if self.outputs:  # what torchmetrics.text.Perplexity reads
            return {"loss": loss, "logits": logits, "target": targets}, state
        return loss if self.wrong_return else (loss, state)


STREAM = ["model._target_=test_carried.CarryRNN", "~model.net", "~model.loss",
          "data.train._target_=test_carried.token_stream", "data.val._target_=test_carried.token_stream",
          "data.val.seed=1", "+data.val.length=81", "~data.train.n", "~data.val.n", "data.batch_size=10",
          "data.shuffle=false", "optimizer=sgd", "optimizer.lr=0.5", "optimizer.max_grad_norm=0.25"]


class Losses:
    """Every training batch's loss, and every evaluation's ``val/loss``."""

    name = "losses"

    def __init__(self):
        self.train: list[float] = []
        self.val: list[float] = []

    @hookimpl
    def on_train_batch_end(self, run, outputs):
        self.train.append(float(outputs["loss"]))

    @hookimpl
    def on_eval_end(self, run, metrics):
        self.val.append(metrics["val/loss"])


def fit(output_dir, *overrides):
    losses = Losses()
    run = csf.Run(fixtures.compose(*STREAM, *overrides), output_dir=output_dir, plugins=[losses])
    assert run.fit()["status"] == "completed"
    return run, losses


@pytest.mark.slow
def test_the_state_is_carried_across_batches_and_starts_anew_at_each_epoch_and_evaluation(tmp_path):
    # 160 samples in batches of 20: 8 batches an epoch; the validation set: 4 batches
    run, losses = fit(tmp_path, "loop.max_steps=20", "loop.eval_every=10", "data.batch_size=20")
    seen = run.model.seen
    training = [kind for kind, train in seen if train]
    assert len(training) == 20
    assert [i for i, kind in enumerate(training) if kind == "initial"] == [0, 8, 16], "once an epoch"
    evaluating = [kind for kind, train in seen if not train]
    assert evaluating == (["initial"] + ["carried"] * 3) * 2, "each evaluation pass from initial_state"
    assert len(losses.val) == 2


@pytest.mark.slow
def test_an_evaluation_in_the_middle_of_an_epoch_leaves_the_training_state_as_it_was(tmp_path):
    _, often = fit(tmp_path / "often", "loop.max_steps=12", "loop.eval_every=5")
    _, rarely = fit(tmp_path / "rarely", "loop.max_steps=12", "loop.eval_every=null")
    assert len(often.val) == 3 and often.train == rarely.train


@pytest.mark.slow
def test_a_run_resumed_in_the_middle_of_an_epoch_goes_on_bit_exactly(tmp_path):
    common = ["loop.max_steps=24", "loop.eval_every=null", "checkpoint.every_steps=20", "checkpoint.keep_last=3"]
    straight_run, straight = fit(tmp_path / "straight", *common)  # step 20: batch 4 of the second epoch
    resumed_run, resumed = fit(tmp_path / "resumed", *common,
                               f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000020'}")
    assert resumed.train == straight.train[20:]
    assert resumed_run.model.seen[0] == ("carried", True), "it goes on with the saved state"
    for a, b in zip(straight_run.model.state_dict().values(), resumed_run.model.state_dict().values()):
        assert torch.equal(a, b)
    assert resumed.val == straight.val


def test_a_forward_that_returns_no_state_is_one_line_naming_the_contract(tmp_path):
    run = csf.Run(fixtures.compose(*STREAM, "loop.max_steps=2", "+model.wrong_return=true"), output_dir=tmp_path)
    with pytest.raises(ModelError, match=r"test_carried.CarryRNN has initial_state, so forward\(batch, state\) "
                                         r"must return \(loss or outputs dict, new state\); it returned a Tensor"):
        run.fit()


@pytest.mark.parametrize("setting, refusal", [
    ("data.shuffle=true", "data.shuffle: test_carried.CarryRNN carries its state from batch to batch "
                          "(initial_state), so its batches must come in order; set data.shuffle=false"),
    ("data.eval_sample=fresh", "data.eval_sample: test_carried.CarryRNN carries its state from batch to batch "
                               "(initial_state), and loop.eval_steps=3 with data.eval_sample=fresh draws batches"),
    ("backend.compile=true", "backend.compile: test_carried.CarryRNN carries its state from batch to batch "
                             "(initial_state), which the compiled step does not pass; set backend.compile=false"),
    ("backend.strategy=ddp", "backend.strategy: test_carried.CarryRNN carries its state from batch to batch "
                             "(initial_state), and under ddp each rank would carry its own"),
    ("device=csx", "device: test_carried.CarryRNN carries its state from batch to batch (initial_state), which "
                   "only the eager CPU/GPU backend passes; use device=cpu or gpu"),
])
def test_what_cannot_carry_the_state_is_refused_when_the_run_is_built(tmp_path, setting, refusal):
    with pytest.raises(ValidationError) as e:
        csf.Run(fixtures.compose(*STREAM, "loop.max_steps=2", "loop.eval_steps=3", "data.eval_sample=sequential",
                                 setting, "mode=check"), output_dir=tmp_path)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(refusal)


def test_a_sequential_evaluation_reads_the_first_batches_in_order(tmp_path):
    class Seen:
        name = "seen"
        batches: list[torch.Tensor] = []

        @hookimpl
        def on_eval_batch_start(self, batch):
            self.batches.append(batch[0].clone())

    seen = Seen()
    run = csf.Run(fixtures.compose(*STREAM, "loop.max_steps=2", "loop.eval_steps=3", "data.eval_sample=sequential"),
                  output_dir=tmp_path, plugins=[seen])
    run.fit()
    first = token_stream(length=81, seed=1).tensors[0][:30]
    assert torch.equal(torch.cat(seen.batches), first)


@pytest.mark.slow
def test_perplexity_from_torchmetrics_is_the_exponential_of_the_whole_sets_loss(tmp_path):
    pytest.importorskip("torchmetrics")
    run, losses = fit(tmp_path, "loop.max_steps=4", "loop.eval_every=null", "+model.outputs=true",
                      "+metrics.ppl._target_=torchmetrics.text.Perplexity", "+metrics.ppl.inputs=[logits,target]")
    # every validation batch holds as many tokens: val/loss is the whole set's mean token loss
    assert run.metrics["val/ppl"] == pytest.approx(math.exp(losses.val[-1]), rel=1e-5)


def test_a_state_of_anything_but_tensors_is_refused_from_forward_and_from_a_checkpoint():
    from csframework.carried import CarriedState
    from csframework.errors import ConfigError

    model = CarryRNN()
    carried = CarriedState(model)
    with pytest.raises(ModelError, match=r"^model.forward: test_carried.CarryRNN.forward\(batch, state\): a carried "
                                         r"state holds a int; make it a tensor, or a tuple, list or dict of tensors$"):
        carried.forward(lambda batch, state: (torch.tensor(1.0), (state, 3)), token_stream()[:10])
    with pytest.raises(ConfigError, match="^checkpoint: its carried state holds a str, not only tensors"):
        carried.load_state_dict({"value": [torch.zeros(1), {"h": "x"}]}, torch.device("cpu"))
    carried.load_state_dict({"value": (torch.zeros(1), {"h": torch.ones(2)})}, torch.device("cpu"))
    assert torch.equal(carried.value[1]["h"], torch.ones(2))


def test_mode_predict_carries_the_state_from_batch_to_batch_from_initial_state(tmp_path):
    """``mode=predict`` on a stateful model called ``forward(batch)`` without its state (a TypeError, the run
    failed); now its pass starts from ``initial_state`` and carries the state on, as an evaluation's does,
    and each sample's outputs are those of that carried pass."""
    import json

    fit(tmp_path / "trained", "loop.max_steps=4", "loop.eval_every=null")
    predict = ["mode=predict", f"checkpoint.resume={tmp_path / 'trained'}", "loop.max_steps=4",
               "+data.predict._target_=test_carried.token_stream", "+data.predict.length=41"]
    run = csf.Run(fixtures.compose(*STREAM, *predict, "+model.outputs=true"), output_dir=tmp_path / "predicted")
    assert run.predict()["predictions"]["rows"] == 40
    assert [kind for kind, training in run.model.seen] == ["initial"] + ["carried"] * 3
    rows = [json.loads(line) for line in (tmp_path / "predicted" / "predictions.jsonl").read_text().splitlines()]
    model = run.model.eval()
    tokens, _ = token_stream(length=41).tensors
    with torch.no_grad():  # the whole stream in one pass: what batches carrying the state compute
        out, _ = model.rnn(model.embed(tokens), torch.zeros(1, tokens.shape[1], model.rnn.hidden_size))
        expected = model.head(out)
    assert torch.allclose(torch.tensor([row["logits"] for row in rows]), expected, atol=1e-5)
