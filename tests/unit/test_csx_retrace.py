"""``retrace_every_iteration`` replays the step's Python and compares its operation stream (issue 48 item 2).

The first trace builds the graph with ``make_fx`` and records the ATen operation stream; every later iteration
replays the step on fake tensors, recording only (``csframework/graph/replay.py``). These tests change the step
at iteration 3 in each way a graph can change (the forward, the loss, a constant, a tensor constant, a shape, the
optimizer's update, its hyperparameters, a hook between backward and update, the state written back, state
created in the step) and check that the change is refused before the changed step runs, naming the line; and
that an unchanged step replays (no second ``make_fx``) with the same numbers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import csframework as csf
from csframework.backends.csx import lowlevel
from csframework.graph import inductor
from csframework.graph.tracer import StepTracer

CHANGE_AT = 3


@pytest.fixture(autouse=True)
def fresh_process_state():
    lowlevel._reset()
    yield
    lowlevel._reset()


@pytest.fixture(params=["checked", "replayed"])
def retrace_path(request, monkeypatch):
    """``checked``: the interpreted graph, whose retraces run on the live tensors; ``replayed``: a compiled
    graph (here the interpreted one behind a stand-in for Inductor's code, which costs minutes to compile),
    whose retraces replay on fake tensors before the compiled code runs."""
    if request.param == "replayed":
        def compile_graph(gm, entry, root, patches):
            return (lambda *inputs: gm.forward(*inputs)), {"status": "compiled", "seconds": 0.0}
        monkeypatch.setattr(inductor, "compile_graph", compile_graph)
        monkeypatch.setenv("CSF_CSX_GRAPH_COMPILER", "inductor")
    return request.param


def data(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def line_of(marker: str) -> int:
    for number, line in enumerate(Path(__file__).read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(marker)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.change: str | None = None  # the change switched on at CHANGE_AT

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.change == "forward":
            h = torch.tanh(h)  # FORWARD
        if self.change == "shape":
            h = torch.cat([h[:, :8], h[:, :8]], dim=1)  # SHAPE
        if self.change == "rebind":
            self.seen = self.seen + 1  # REBIND
        else:
            self.seen.add_(1)
        return self.b(h)


class Counted(torch.optim.SGD):
    """SGD with a Python switch in its update and a ``preinitialize`` (its state exists before the trace)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.change: str | None = None

    def preinitialize(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p]["momentum_buffer"]
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf * (2.0 if self.change == "update" else 1.0), alpha=-0.1)  # UPDATE
                if self.change == "new_state":
                    self.state[p]["extra"] = buf  # NEW_STATE


def train(steps: int, tmp_path, change: str | None = None, make_optimizer=Counted, retrace: bool = True,
          out: dict | None = None):
    """The low-level loop; ``change`` is switched on at iteration CHANGE_AT. Returns (model, losses, backend),
    also kept in ``out`` as they are made (for a loop that raises)."""
    backend = csf.backend("CSX", retrace_every_iteration=retrace, compile_dir=str(tmp_path / "compile"))
    model = Net()
    compiled = csf.compile(model, backend)
    optimizer = make_optimizer(model.parameters(), lr=0.1)
    iteration = 0
    losses: list = []
    if out is not None:
        out.update(model=model, backend=backend, losses=losses, optimizer=optimizer)

    @csf.trace
    def step(x, y):
        nonlocal iteration
        iteration += 1
        on = change if iteration >= CHANGE_AT else None
        model.change = on
        if isinstance(optimizer, Counted):
            optimizer.change = on
        smoothing = 0.1 if on == "loss" else 0.0
        loss = nn.functional.cross_entropy(compiled(x), y, label_smoothing=smoothing)  # LOSS
        if on == "constant":
            loss = loss * 0.5  # CONSTANT
        loss = loss * torch.tensor([1.0, 3.0] if on == "tensor_constant" else [1.0, 1.0]).mean()  # TENSOR_CONSTANT
        loss.backward()
        if on == "hook":
            for p in model.parameters():
                p.grad.mul_(0.5)  # HOOK
        if on == "hyper":
            optimizer.param_groups[0]["momentum"] = 0.5
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for i in range(steps):
        x, y = data(i)
        if change == "batch" and i + 1 >= CHANGE_AT:
            x, y = x[:8], y[:8]
        losses.append(step(x, y))
    return model, losses, backend


def momentum_sgd(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


CHANGES = [("forward", "aten.tanh", "FORWARD"), ("loss", "aten", "LOSS"), ("constant", "0.5", "CONSTANT"),
           ("tensor_constant", "constant", "TENSOR_CONSTANT"), ("shape", "aten.slice", "SHAPE"),
           ("update", "2.0", "UPDATE"), ("hook", "aten.mul_", "HOOK"), ("rebind", "aten.add", "REBIND")]


@pytest.mark.parametrize("change, needle, marker", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_change_at_a_later_iteration_is_refused_before_it_runs(tmp_path, change, needle, marker, retrace_path):
    out: dict = {}
    with pytest.raises(csf.CompileError, match=f"iteration {CHANGE_AT}") as info:
        train(CHANGE_AT + 1, tmp_path, change, out=out)
    message = str(info.value)
    assert "differs from the first trace" in message and needle in message, message
    assert f"test_csx_retrace.py:{line_of(marker)}" in message, message
    assert len(out["losses"]) == CHANGE_AT - 1
    lowlevel._reset()
    reference: dict = {}
    train(CHANGE_AT - 1, tmp_path / "unchanged", out=reference)
    # the changed step never ran: parameters, buffers and optimizer state (written before the difference, in
    # "update") are those after the unchanged steps
    assert all(torch.equal(a, b) for a, b in zip(reference["model"].state_dict().values(),
                                                 out["model"].state_dict().values()))
    buffers = [[st["momentum_buffer"] for st in run["optimizer"].state.values()] for run in (reference, out)]
    assert all(torch.equal(a, b) for a, b in zip(*buffers))


@pytest.mark.parametrize("change, make_optimizer", [("hyper", momentum_sgd), ("batch", Counted)])
def test_a_changed_optimizer_setting_or_batch_shape_is_refused(tmp_path, change, make_optimizer):
    """A changed hyperparameter or input shape is a new signature: a whole trace, compared graph to graph."""
    with pytest.raises(csf.CompileError, match=f"iteration {CHANGE_AT}") as info:
        train(CHANGE_AT + 1, tmp_path, change, make_optimizer)
    assert "differs from the first trace" in str(info.value)


def test_state_created_in_a_later_step_is_a_tracing_error(tmp_path):
    with pytest.raises(csf.TracingError, match="creates state 'extra'") as info:
        train(CHANGE_AT + 1, tmp_path, "new_state")
    assert f"test_csx_retrace.py:{line_of('NEW_STATE')}" in str(info.value)


@pytest.mark.requires_torch((2, 5), "replaying a retrace (a higher-order operator cannot pass a dispatch mode before)")
def test_an_unchanged_step_is_replayed_not_retraced_and_gives_the_same_numbers(tmp_path, monkeypatch,
                                                                             retrace_path):
    """One make_fx trace for six iterations (five replays); the losses and parameters are bit for bit those of
    the same loop traced once, and every iteration ran its Python (the replay counts as a trace)."""
    traces = []
    real_trace = StepTracer.trace
    monkeypatch.setattr(StepTracer, "trace", lambda self, *a: traces.append(1) or real_trace(self, *a))
    model, losses, backend = train(6, tmp_path)
    assert len(traces) == 1 and backend.traces == 6
    lowlevel._reset()
    once, once_losses, once_backend = train(6, tmp_path / "once", retrace=False)
    assert once_backend.traces == 1
    assert [float(v) for v in losses] == [float(v) for v in once_losses]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), once.state_dict().values()))


def test_the_default_run_interprets_its_graph_and_its_summary_gives_the_seconds_apart(tmp_path, monkeypatch):
    """No Inductor compile unless asked (issue 48 item 1); summary.json's trace, graph compile and training
    seconds (item 3): compile_seconds is the tracing (replays included) and the graph's compile."""
    from csx_runs import run_on

    monkeypatch.delenv("CSF_CSX_GRAPH_COMPILER", raising=False)
    run, summary = run_on("csx", tmp_path, "loop.max_steps=4", "backend.retrace_every_iteration=true",
                          "data.val=null")
    assert summary["graph_compiler"] == "interpreted" and summary["traces"] == 4
    written = json.loads((tmp_path / "csx" / "summary.json").read_text())
    assert written["trace_seconds"] > 0 and written["graph_compile_seconds"] >= 0 and written["train_seconds"] > 0
    assert written["compile_seconds"] == pytest.approx(written["trace_seconds"] + written["graph_compile_seconds"],
                                                       abs=2e-3)


def test_a_step_with_a_higher_order_operator_is_traced_whole_at_every_retrace(tmp_path, monkeypatch):
    """``torch.cond``'s branches are not in the recorded stream: such a step is never replayed."""
    traces = []
    real_trace = StepTracer.trace
    monkeypatch.setattr(StepTracer, "trace", lambda self, *a: traces.append(1) or real_trace(self, *a))
    backend = csf.backend("CSX", retrace_every_iteration=True, compile_dir=str(tmp_path))
    model = Net()
    compiled = csf.compile(model, backend)
    optimizer = Counted(model.parameters(), lr=0.1)

    @csf.trace
    def step(x, y):
        x = torch.cond(x.sum() > 0, lambda t: t * 2.0, lambda t: t * 0.5, (x,))  # the batch: no autograd
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for i in range(3):
        step(*data(i))
    assert len(traces) == 3 and backend.traces == 3


@pytest.mark.parametrize("overrides", [["precision=cbfloat16"], ["precision=float16", "precision.init_scale=1e30"],
                                       ["loop.grad_accum_steps=2"]], ids=["cbfloat16", "float16-overflow", "accum"])
def test_retraced_runs_give_the_traced_once_numbers(tmp_path, overrides):
    """The checked retrace through Run: CB16 rounding, dynamic loss scaling (with skipped steps: an initial
    scale of 1e30 overflows), gradient accumulation; parameters, losses and the loss scale bit for bit."""
    from csx_runs import params_of, run_on

    common = ["loop.max_steps=6", "loop.log_every=1", "data.val=null", *overrides]
    once, _ = run_on("csx", tmp_path, *common, name="once")
    again, summary = run_on("csx", tmp_path, *common, "backend.retrace_every_iteration=true", name="again")
    assert summary["traces"] == 6 and summary["status"] == "completed"
    assert all(torch.equal(a, b) for a, b in zip(params_of(once).values(), params_of(again).values()))
    losses = [[row.split(",")[3] for row in (tmp_path / name / "metrics.csv").read_text().splitlines()[1:]
               if row.split(",")[2] == "train/loss"] for name in ("once", "again")]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
    assert once.backend.loss_scale() == again.backend.loss_scale()
