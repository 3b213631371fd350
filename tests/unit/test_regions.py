"""Regional compilation (``csframework.backends.compile.regions``): a model's repeated blocks found, each block's code
compiled once for every layer, the user's model left as it was."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import csframework as csf
from csframework.backends.compile import findings, payoff, regions
from csframework.defaults.model import Block, TinyTransformer


def test_a_transformers_layers_are_its_repeated_blocks():
    model = TinyTransformer(n_layers=4)
    assert regions.repeated_blocks(model) == list(model.blocks)  # not the Linear layers inside each block
    assert regions.describe(regions.repeated_blocks(model)) == "4 x Block"


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),  # one operation each
    nn.ModuleList([Block(16, 2, 0.0), Block(32, 2, 0.0)]),  # one class, other shapes
    TinyTransformer(n_layers=1),
])
def test_layers_that_are_one_operation_or_differ_in_shape_are_not_blocks(model):
    assert regions.repeated_blocks(model) == []


@pytest.mark.requires_torch((2, 5), "regional compilation")
def test_the_compiled_forward_is_on_the_blocks_only_while_the_step_runs_them():
    model = TinyTransformer(n_layers=2)
    found = regions.find(model, compile=lambda function: function)  # (no compiler: the mechanism alone)
    assert found is not None and len(found) == 2
    batch = (torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    expected = model(batch)["loss"]
    with found.installed():
        assert all("forward" in vars(block) for block in model.blocks)
        assert torch.equal(model(batch)["loss"], expected)
    assert all("forward" not in vars(block) for block in model.blocks)  # the user's model as it was


@pytest.mark.slow
@pytest.mark.requires_torch((2, 5), "regional compilation")
def test_a_4_layer_model_compiles_its_block_once(tmp_path, monkeypatch):
    """Issue 38's acceptance: the 4-layer transformer's training forward, compiled per function (a CPU's default
    for a model of repeated blocks, as on a GPU or under DDP), is one graph of one block (its 12 parameters and its
    input), compiled once and run for every layer; evaluation compiles the block once more (no backward: another
    graph); the update is torch's fused kernel, nothing to compile; the parameters agree with eager training."""
    graphs: list[int] = []  # each compiled graph's inputs
    recorder_call = findings.Recorder.__call__

    def counting(self, gm, example_inputs):
        graphs.append(len(example_inputs))
        return recorder_call(self, gm, example_inputs)

    monkeypatch.setattr(findings.Recorder, "__call__", counting)
    common = ["model.n_layers=4", "loop.max_steps=4", "loop.log_every=2", "loop.eval_every=4", "loop.eval_steps=1",
              "backend.threads=1", "optimizer=sgd", "optimizer.lr=0.1", "optimizer.schedule.warmup_steps=0"]
    eager = csf.Run(csf.compose(common), output_dir=tmp_path / "eager")
    eager.fit()
    run = csf.Run(csf.compose([*common, "backend.compile=true"]), output_dir=tmp_path / "compiled")
    summary = run.fit()
    assert summary["compile"]["graph"] == "per function" and summary["compile"]["regions"] == "4 x Block"
    assert summary["compile"]["recompiles"] == 0 and summary["compile"]["graph_breaks"] == 0
    events = [json.loads(line) for line in (tmp_path / "compiled" / "events.jsonl").read_text().splitlines()]
    why = [e["reason"] for e in events if e["event"] == "step_compiled_per_function"]
    assert len(why) == 1 and "the model repeats a block (4 x Block)" in why[0]
    assert [e["function"] for e in events if e["event"] == "step_compiled"] == ["forward", "evaluate"]
    assert run.backend.compiled.update == "fused"
    # one graph of one block (its parameters and its input) for training, one for evaluation, none per layer
    one_layer = len(list(run.model.blocks[0].parameters())) + 1
    assert graphs == [one_layer, one_layer] and run.backend.compiled.recorder.graphs == 2
    for name, value in run.model.state_dict().items():
        assert torch.allclose(value, eager.model.state_dict()[name], atol=1e-5), name


# -- compile_not_faster (csframework.backends.compile.payoff) --------------------------------------------------------------
class Clock:
    """A clock that advances by ``step`` seconds whenever it is read."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _steps(check: payoff.Payoff, steps: int, compile_at=()) -> list:
    """``steps`` steps through ``check``; those in ``compile_at`` compile (the compile time grows while they run)."""
    spent = [0.0]

    def train(compiles: bool) -> dict:
        spent[0] += 1.0 if compiles else 0.0
        return {}

    verdicts = []
    for global_step in range(steps):
        check.step(global_step, lambda: train(global_step in compile_at), lambda: spent[0], eager=dict)
        verdicts.append(check.verdict())
    return verdicts


def test_the_payoff_check_times_the_first_window_then_three_eager_steps(monkeypatch):
    monkeypatch.setattr(payoff, "perf_counter", Clock(0.5))  # every step takes 0.5 s: not faster
    check = payoff.Payoff(window=4)
    assert [check.eager_step(g) for g in range(8)] == [False] * 4 + [True] * 3 + [False]
    verdicts = _steps(check, 10, compile_at={0})
    assert len(check.compiled) == 3 and len(check.eager) == 3  # the step that compiled is not timed
    assert verdicts == [None] * 6 + [(0.5, 0.5, None)] + [None] * 3  # once, after the last eager step
    assert not any(check.eager_step(g) for g in range(10))


def test_a_faster_compiled_step_gives_no_verdict(monkeypatch):
    check = payoff.Payoff(window=2)
    monkeypatch.setattr(payoff, "perf_counter", Clock(0.1))
    _steps(check, 2)
    monkeypatch.setattr(payoff, "perf_counter", Clock(0.3))  # the eager steps are slower
    assert _steps_from(check, 2, 6) == [None] * 4


@pytest.mark.parametrize("steps, compile_seconds, said", [(300, 40.0, True), (300, 0.01, False), (None, 40.0, False)])
def test_a_faster_compiled_step_that_cannot_win_back_the_compile_is_said(monkeypatch, steps, compile_seconds, said):
    """Issue 50 item 4: a small MLP's compiled step is a little faster (0.1 ms here), and compiling took 40 s:
    300 steps save 0.03 s, so compiling does not pay; said with the medians and how to turn compile off."""
    check = payoff.Payoff(window=2, steps=steps)
    monkeypatch.setattr(payoff, "perf_counter", Clock(0.1e-3))
    _steps(check, 2)
    monkeypatch.setattr(payoff, "perf_counter", Clock(0.2e-3))  # the eager steps take 0.1 ms more
    verdicts = []
    for global_step in range(2, 6):
        check.step(global_step, lambda: {}, lambda: 0.0, eager=dict)
        verdicts.append(check.verdict(compile_seconds))
    found = [v for v in verdicts if v is not None]
    assert len(found) == int(said)
    if said:
        event = found[0].event(compile_seconds, steps)
        assert (event["compiled_ms"], event["eager_ms"], event["compile_seconds"]) == (0.1, 0.2, 40.0)
        assert event["problem"].endswith("over the stage's 300 steps it saves 0.03 s, and compiling took 40.0 s")
        assert "backend.compile=false" in event["result"]


def _steps_from(check: payoff.Payoff, start: int, stop: int) -> list:
    out = []
    for global_step in range(start, stop):
        check.step(global_step, lambda: {}, lambda: 0.0, eager=dict)
        out.append(check.verdict())
    return out


@pytest.mark.slow
def test_a_compiled_step_no_faster_than_eager_is_said_once_with_both_figures(tmp_path, monkeypatch):
    from fixtures import compose

    monkeypatch.setattr(payoff, "perf_counter", Clock(2.0 ** -9))  # every step: 1.953125 ms (exact), compiled or eager
    run = csf.Run(compose("loop.max_steps=12", "loop.log_every=4", "backend.threads=1", "backend.compile=true"),
                  output_dir=tmp_path)
    summary = run.fit()
    assert summary["status"] == "completed"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    said = [e for e in events if e["event"] == "compile_not_faster"]
    assert len(said) == 1 and said[0]["level"] == "warning", said
    assert said[0]["compiled_ms"] == said[0]["eager_ms"] == 1.953
    assert "backend.compile=false" in said[0]["result"]


def dropout_mlp(dim: int = 8, hidden: int = 16, classes: int = 4) -> nn.Module:
    """The Blobs MLP with dropout: each step draws random numbers."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.5), nn.Linear(hidden, classes))


class BackwardCounter:
    """A plugin inside the step (so the step's functions are compiled, not one graph): counts the backwards."""
    name = "backward_counter"

    def __init__(self):
        self.calls = 0

    @csf.hookimpl
    def on_after_backward(self):
        self.calls += 1


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["whole step", "per function"])
def test_the_payoff_checks_eager_steps_leave_the_run_as_it_would_be_without_them(tmp_path, monkeypatch, graph):
    """Issue 51 item 3: the eager steps the check times are thrown away (until then they trained the model
    eagerly, with eager's rounding, in the middle of a compiled run): a run with the check trains bit for bit as
    one whose check window lies past its end, dropout's random numbers included, and a plugin inside the step
    sees the run's steps only."""
    from fixtures import compose

    monkeypatch.setattr(payoff, "perf_counter", Clock(2.0 ** -9))  # equal medians: the check says so, once
    common = ["loop.max_steps=12", "backend.threads=1", "backend.compile=true", "optimizer=adamw",
              "optimizer.lr=0.01", f"model.net._target_={__name__}.dropout_mlp"]
    runs, counters = {}, {}
    for name, window in (("checked", 4), ("unchecked", 12)):
        counters[name] = BackwardCounter()
        runs[name] = csf.Run(compose(*common, f"loop.log_every={window}"), output_dir=tmp_path / name,
                             plugins=[counters[name]] if graph == "per function" else [])
        assert runs[name].fit()["compile"]["graph"] == graph
    events = [json.loads(line) for line in (tmp_path / "checked" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] == "compile_not_faster"] == ["compile_not_faster"]
    checked, unchecked = runs["checked"].model.state_dict(), runs["unchecked"].model.state_dict()
    assert all(torch.equal(checked[k], unchecked[k]) for k in checked)
    assert all(torch.equal(a, b) for a, b in zip(runs["checked"].optimizer.state_dict()["state"][0].values(),
                                                runs["unchecked"].optimizer.state_dict()["state"][0].values()))
    if graph == "per function":
        assert counters["checked"].calls == counters["unchecked"].calls == 12


def test_set_aside_puts_back_in_place_what_a_thrown_away_step_changed():
    """The payoff check's eager step changes nothing the run keeps: parameters, running statistics, gradients,
    the optimizer's state (the same tensors: compiled code holding them stays valid; entries the step created
    removed), a loss scale and the random number generator."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)

    def train() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train()
    model[3].bias.requires_grad_(False)  # a parameter without optimizer state until now
    scale = torch.tensor(65536.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {p: {k: (v, v.clone()) for k, v in s.items()} for p, s in optimizer.state.items()}
    model[3].bias.requires_grad_(True)
    rng = torch.get_rng_state()
    with payoff.set_aside(model, optimizer, [scale]):
        train()
        scale.mul_(2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert set(optimizer.state) == set(state)  # the bias's new state is gone
    for p, entries in state.items():
        assert all(optimizer.state[p][k] is tensor and torch.equal(tensor, kept) for k, (tensor, kept) in entries.items())
    assert float(scale) == 65536.0
    assert torch.equal(torch.get_rng_state(), rng)  # the next step's dropout draws what it would have
