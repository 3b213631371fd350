"""``csframework.backends.csx.lowlevel``.

The low-level API mirroring ``cerebras.pytorch``: ``csf.backend``, ``csf.compile``, ``@csf.trace``,
``@csf.step_closure`` (issue 3, items 4, 5, 8, 9)."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

import csframework as csf
from csframework.backends.csx import lowlevel


@pytest.fixture(autouse=True)
def fresh_process_state():
    lowlevel._reset()
    yield
    lowlevel._reset()


def data(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def line_of(marker: str) -> int:
    for number, line in enumerate(Path(__file__).read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(marker)


def train_loop(kind: str, steps: int = 5, tmp_path=None, make_optimizer=None, **settings):
    """The cstorch-style custom loop; returns (model, losses from the step, values seen by a closure)."""
    if kind == "CSX":
        settings.setdefault("compile_dir", str(tmp_path / "compile"))
    backend = csf.backend(kind, **settings)
    model = net()
    compiled_model = csf.compile(model, backend)
    optimizer = (make_optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    seen = []

    @csf.step_closure
    def log(loss, logits):
        seen.append((loss.item(), logits.sum().item()))

    @csf.trace
    def training_step(inputs, targets):
        outputs = compiled_model(inputs)
        loss = loss_fn(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        log(loss, outputs)
        return loss

    losses = [training_step(*data(i)) for i in range(steps)]
    return model, losses, seen, backend


def test_the_seed_example_runs(tmp_path):
    """seeds/001: the documented static-graph example, with cstorch replaced by csf."""
    model = net()
    backend = csf.backend("CSX", retrace_every_iteration=True, compile_dir=str(tmp_path))
    compiled_model = csf.compile(model, backend)
    loss_fn = torch.nn.CrossEntropyLoss()

    @csf.trace
    def training_step(inputs, targets):
        outputs = compiled_model(inputs)
        loss = loss_fn(outputs, targets)

        return loss

    for i in range(3):
        x, y = data(i)
        loss = training_step(x, y)
        assert torch.allclose(loss, loss_fn(model(x), y).detach())
    assert backend.traces == 3


@pytest.mark.parametrize("retrace", [False, True])
def test_training_matches_the_same_loop_on_cpu(tmp_path, retrace):
    eager, eager_losses, eager_seen, _ = train_loop("CPU", 6)
    lowlevel._reset()
    model, losses, seen, backend = train_loop("CSX", 6, tmp_path, retrace_every_iteration=retrace)
    assert backend.traces == (6 if retrace else 1)
    for a, b in zip(eager.parameters(), model.parameters()):
        assert (a - b).abs().max() <= 1e-6
    assert torch.allclose(torch.stack(losses), torch.stack(eager_losses), atol=1e-6)
    assert not losses[0].requires_grad
    # step closures ran after every step with that step's values, as the same closure did eagerly
    assert len(seen) == 6 and [v for pair in seen for v in pair] == pytest.approx(
        [v for pair in eager_seen for v in pair], abs=1e-5)
    assert len({loss for loss, _ in seen}) == 6


@pytest.mark.parametrize("retrace, expected", [(False, 1), (True, 5)])
def test_print_and_python_counter_run_once_per_trace(tmp_path, capsys, retrace, expected):
    backend = csf.backend("csx", retrace_every_iteration=retrace, compile_dir=str(tmp_path))
    model = csf.compile(net(), backend)
    calls = {"n": 0}

    @csf.trace
    def step(x):
        calls["n"] += 1
        print("tracing the step", calls["n"])
        return model(x).sum()

    for i in range(5):
        step(data(i)[0])
    assert calls["n"] == expected
    assert capsys.readouterr().out.count("tracing the step") == expected


def reading_step(model, kind):
    @csf.trace
    def step(x):
        loss = model(x).pow(2).mean()
        if kind == "if":
            if loss > 0:  # LOW-IF
                loss = loss * 2
        elif kind == "item":
            print(loss.item())  # LOW-ITEM
        elif kind == "bool":
            assert bool(loss)  # LOW-BOOL
        elif kind == "to":
            loss = loss.to("cpu")  # LOW-TO
        return loss
    return step


@pytest.mark.parametrize("kind, marker", [("if", "LOW-IF"), ("item", "LOW-ITEM"), ("bool", "LOW-BOOL"),
                                          ("to", "LOW-TO")])
def test_tracing_errors_name_the_users_line_and_the_fix(tmp_path, kind, marker):
    backend = csf.backend("CSX", compile_dir=str(tmp_path))
    step = reading_step(csf.compile(net(), backend), kind)
    with pytest.raises(csf.TracingError) as info:
        step(data()[0])
    message = str(info.value)
    assert f"test_csx_lowlevel.py:{line_of(marker)}" in message, message
    assert "torch.where" in message or "step_closure" in message
    del backend, step
    lowlevel._reset()
    cpu = csf.backend("cpu")
    assert reading_step(csf.compile(net(), cpu), kind)(data()[0]).ndim == 0  # same code, eagerly


def test_retrace_detects_a_changed_graph_before_running_it(tmp_path):
    backend = csf.backend("CSX", retrace_every_iteration=True, compile_dir=str(tmp_path))
    model = net()
    compiled = csf.compile(model, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    count = {"n": 0}
    snapshots = []

    @csf.trace
    def step(x, y):
        count["n"] += 1
        loss = nn.functional.cross_entropy(compiled(x), y)
        for _ in range(1 if count["n"] < 3 else 2):  # a Python loop, unrolled differently at iteration 3
            loss = loss + 0.0
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for i in range(2):
        step(*data(i))
        snapshots.append([p.detach().clone() for p in model.parameters()])
    with pytest.raises(csf.CompileError, match="iteration 3") as info:
        step(*data(2))
    assert "a second compile is not allowed" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(snapshots[-1], model.parameters()))


def test_schedules_change_the_learning_rate_with_one_graph(tmp_path):
    def run(kind):
        backend = csf.backend(kind, **({"compile_dir": str(tmp_path)} if kind == "CSX" else {}))
        model = net()
        compiled = csf.compile(model, backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))

        @csf.trace
        def step(x, y):
            loss = nn.functional.cross_entropy(compiled(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        for i in range(6):
            step(*data(i))
            scheduler.step()
        return model, backend

    eager, _ = run("CPU")
    lowlevel._reset()
    model, backend = run("CSX")
    assert backend.traces == 1
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), model.parameters()))  # bit-identical


class GrowingSGD(torch.optim.Optimizer):
    """A custom optimizer that creates its state lazily inside step(), as eager code may."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "velocity" not in state:
                    state["velocity"] = torch.zeros_like(p)  # CREATES-STATE
                state["velocity"].mul_(0.5).add_(p.grad)
                p.sub_(group["lr"] * state["velocity"])


class PreinitializedSGD(GrowingSGD):
    def preinitialize(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("velocity", torch.zeros_like(p))


def test_custom_optimizer_state_must_be_preinitialized(tmp_path):
    with pytest.raises(csf.TracingError) as info:
        train_loop("CSX", 2, tmp_path, make_optimizer=GrowingSGD)
    message = str(info.value)
    assert "velocity" in message and "preinitialize" in message
    assert f"test_csx_lowlevel.py:{line_of('CREATES-STATE')}" in message
    lowlevel._reset()
    eager, *_ = train_loop("CPU", 4, make_optimizer=PreinitializedSGD)
    lowlevel._reset()
    model, _, _, backend = train_loop("CSX", 4, tmp_path, make_optimizer=PreinitializedSGD)
    assert backend.traces == 1
    for a, b in zip(eager.parameters(), model.parameters()):
        assert (a - b).abs().max() <= 1e-6


def test_an_optimizer_the_backend_cannot_see_is_named(tmp_path):
    backend = csf.backend("CSX", compile_dir=str(tmp_path))
    model = net()
    compiled = csf.compile(model, backend)
    holder = type("Holder", (), {})()
    holder.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def make_step():
        @csf.trace
        def step(x, y):
            nn.functional.cross_entropy(compiled(x), y).backward()
            opt = getattr(holder, "optimizer")
            opt.step()  # HIDDEN-OPTIMIZER
            opt.zero_grad()
        return step

    with pytest.raises(csf.TracingError, match="register_optimizer") as info:
        make_step()(*data())
    assert f"test_csx_lowlevel.py:{line_of('HIDDEN-OPTIMIZER')}" in str(info.value)
    before = [p.detach().clone() for p in model.parameters()]
    backend.register_optimizer(holder.optimizer)
    make_step()(*data())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_only_one_compiled_model_per_step(tmp_path):
    backend = csf.backend("CSX", compile_dir=str(tmp_path))
    first, second = csf.compile(net(), backend), csf.compile(net(), backend)

    @csf.trace
    def step(x):
        return first(x).sum() + second(x).sum()

    with pytest.raises(csf.CompileError, match="only one compiled model per step"):
        step(data()[0])


def test_backend_types_settings_and_one_device_type_per_process(tmp_path):
    csx = csf.backend("cSx", compile_dir=str(tmp_path))
    assert csx.device_type == "CSX" and csx.is_csx
    with pytest.raises(csf.ConfigError, match="a CSX backend already exists"):
        csf.backend("CPU")
    same = csf.backend("CSX", compile_dir=str(tmp_path))  # a second one of the same type is fine
    del csx, same
    gc.collect()
    cpu = csf.backend("cpu")  # the CSX backends are gone
    assert cpu.device_type == "CPU" and not cpu.is_csx
    for setting in ("retrace_every_iteration", "compile_only", "num_csx"):
        with pytest.raises(csf.ConfigError, match=f"{setting} is a CSX setting"):
            csf.backend("CPU", **{setting: True})
    with pytest.raises(csf.ConfigError, match="unknown backend type"):
        csf.backend("TPU")
    with pytest.raises(csf.ConfigError, match="num_csx"):
        lowlevel._reset()
        csf.backend("CSX", num_csx=0)


def test_num_csx_larger_than_the_batch_is_refused(tmp_path):
    backend = csf.backend("CSX", num_csx=32, compile_dir=str(tmp_path))
    model = csf.compile(net(), backend)
    step = csf.trace(lambda x: model(x).sum())
    with pytest.raises(csf.CompileError, match="num_csx=32 is larger than the batch size 16"):
        step(data()[0])


def test_validate_only_and_compile_only(tmp_path):
    for mode in ("validate_only", "compile_only", "compile_only"):
        lowlevel._reset()
        model, losses, seen, backend = train_loop("CSX", 3, tmp_path, **{mode: True})
        fresh = net()
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
        assert losses == [None] * 3 and seen == []
        if mode == "compile_only":
            report = backend.compile_report
            assert report["ops"]["total"] > 10 and report["memory"]["parameter_bytes"] == 4 * (8 * 16 + 16 + 16 * 4 + 4)
            statuses = getattr(test_validate_only_and_compile_only, "statuses", [])
            statuses.append(report["cache"]["status"])
            test_validate_only_and_compile_only.statuses = statuses
    assert test_validate_only_and_compile_only.statuses == ["miss", "hit"]


def test_shape_changes_need_a_second_compile(tmp_path):
    backend = csf.backend("CSX", compile_dir=str(tmp_path))
    model = csf.compile(net(), backend)
    step = csf.trace(lambda x: model(x).sum())
    step(torch.randn(16, 8))
    with pytest.raises(csf.CompileError, match=r"iteration 2 .*shape \[16, 8\] float32 when traced, shape \[5, 8\]"):
        step(torch.randn(5, 8))


def test_a_traced_function_inside_another_is_refused(tmp_path):
    backend = csf.backend("CSX", compile_dir=str(tmp_path))
    model = csf.compile(net(), backend)
    inner = csf.trace(lambda x: model(x).sum())
    outer = csf.trace(lambda x: inner(x) * 2)
    with pytest.raises(csf.CompileError, match="called inside the traced step"):
        outer(data()[0])
    assert inner(data()[0]).ndim == 0  # nothing was left half-traced


def test_retraced_steps_return_this_iterations_python_values(tmp_path):
    backend = csf.backend("CSX", retrace_every_iteration=True, compile_dir=str(tmp_path))
    model = csf.compile(net(), backend)
    count = {"n": 0}

    @csf.trace
    def step(x):
        count["n"] += 1
        return {"loss": model(x).sum(), "iteration": count["n"]}

    assert [step(data(i)[0])["iteration"] for i in range(3)] == [1, 2, 3]
