"""What ``backend.compile`` sets up without compiling anything (fast; run on every supported torch): which
optimizers run torch's own update, the learning rate as a tensor for any optimizer, and the process-wide torch
settings held only while a run's compiled step runs (``backends/compile/scope.py``), which runner a stage's
step gets (``whole_step.refusal``) and a static step's bound on its graphs."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from csframework.backends.compile.scope import CACHE_ENV, CompileScope, fresh
from csframework.backends.compile.update import prepare_optimizer, torch_optimizer
from csframework.backends.compile.whole_step import refusal
from csframework.compat import needs_torch, recompile_limit_key
from csframework.graph.compiler import StaticStep
from csframework.graph.inductor import STANDALONE_TORCH
from csframework.graph.optim import builtin_base, is_builtin, preinitialisable


class GroupedAdamW(torch.optim.AdamW):
    """A user's subclass that only sets its parameter groups: torch's update."""

    def __init__(self, params, lr=1e-3):
        params = list(params)
        super().__init__([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
                         lr=lr)


class OwnStepAdamW(torch.optim.AdamW):
    """A subclass with an update of its own."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


class Plain(torch.optim.Optimizer):
    """Not one of torch's: its step reads the rate as a number."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


def params():
    return list(nn.Linear(3, 2).parameters())


def test_a_subclass_keeping_torchs_update_is_recognised_as_torchs():
    # before: the class's module was read, so a user's subclass was "not torch's"
    assert builtin_base(GroupedAdamW) is torch.optim.AdamW and preinitialisable(GroupedAdamW)
    assert is_builtin(GroupedAdamW(params())) and torch_optimizer(GroupedAdamW(params()))
    assert torch_optimizer(torch.optim.RMSprop(params())) and not is_builtin(torch.optim.RMSprop(params()))
    assert builtin_base(torch.optim.SGD) is torch.optim.SGD and builtin_base(torch.optim.Adam) is torch.optim.Adam


def test_a_subclass_with_its_own_step_is_not_torchs_update():
    assert builtin_base(OwnStepAdamW) is None and not preinitialisable(OwnStepAdamW)
    assert not torch_optimizer(OwnStepAdamW(params())) and not torch_optimizer(Plain(params()))


def test_every_optimizers_rate_becomes_a_tensor_that_its_own_step_reads_as_a_number():
    weights = params()
    plain = Plain(weights, lr=0.5)
    prepare_optimizer(plain, torch.device("cpu"))
    lr = plain.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float64 and float(lr) == 0.5
    assert "foreach" not in plain.param_groups[0]  # only torch's own update gets torch's settings
    before = [w.detach().clone() for w in weights]
    for w in weights:
        w.grad = torch.ones_like(w)
    plain.step()
    assert all(torch.equal(w, b - 0.5) for w, b in zip(weights, before))
    adamw = GroupedAdamW(params())
    prepare_optimizer(adamw, torch.device("cpu"))
    assert all(g["foreach"] and g["capturable"] and isinstance(g["lr"], torch.Tensor) for g in adamw.param_groups)


def test_a_group_without_a_rate_is_left_alone():
    class NoRate(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": None})

    optimizer = NoRate(params())
    prepare_optimizer(optimizer, torch.device("cpu"))
    assert optimizer.param_groups[0]["lr"] is None


def _settings() -> dict:
    import torch._dynamo.config as dynamo_config

    return {"env": os.environ.get(CACHE_ENV), "limit": getattr(dynamo_config, recompile_limit_key()),
            "handlers": {name: list(logging.getLogger(name).handlers) for name in ("torch", "torch._dynamo")}}


def test_the_scope_sets_the_settings_while_entered_and_restores_them(tmp_path, monkeypatch):
    import torch._dynamo.config as dynamo_config

    monkeypatch.delenv(CACHE_ENV, raising=False)
    records = []
    scope = CompileScope(str(tmp_path), 11, records.append)
    before = _settings()
    for _ in range(2):  # entered again after a close (the next stage, a validate after fit)
        scope.enter()
        scope.enter()  # (entered already: nothing more to restore)
        assert os.environ[CACHE_ENV] == str(tmp_path) and getattr(dynamo_config, recompile_limit_key()) == 11
        logging.getLogger("torch._dynamo.convert_frame").warning("hit config.recompile_limit")
        scope.close()
        assert _settings() == before
    assert [r.getMessage() for r in records] == ["hit config.recompile_limit"] * 2
    assert CACHE_ENV not in os.environ  # unset before: unset after (Inductor's own default is not written)


def test_other_torch_records_reach_torchs_handlers_in_the_scope(tmp_path):
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.name)

    torch_logger = logging.getLogger("torch")
    keep = Keep()
    torch_logger.addHandler(keep)
    try:
        records = []
        scope = CompileScope(str(tmp_path), 10, records.append)
        scope.enter()
        logging.getLogger("torch.utils.data").warning("a data loader's warning")
        logging.getLogger("torch._guards").warning("a compile record")
        scope.close()
    finally:
        torch_logger.removeHandler(keep)
    assert seen == ["torch.utils.data"] and [r.name for r in records] == ["torch._guards"]


def test_a_fresh_method_has_its_own_code_and_the_same_behaviour():
    class Counter:
        def __init__(self):
            self.n = 0

        def add(self, k):
            self.n += k
            return self.n

    counter = Counter()
    copy = fresh(counter.add)
    assert copy.__func__.__code__ is not Counter.add.__code__
    assert copy(2) == 2 and counter.add(3) == 5


def test_under_debug_torchs_log_handlers_stay_as_they_are(tmp_path):
    before = _settings()["handlers"]
    scope = CompileScope(str(tmp_path), 10, None)  # debug=true: no sink, torch prints its own lines
    scope.enter()
    try:
        assert _settings()["handlers"] == before
    finally:
        scope.close()


# -- which runner: the whole step's graph or the functions, from plain values --------------------------------
WHOLE = dict(device_type="cpu", distributed=False, accum=1, optimizer=torch.optim.AdamW, hooked=())


@pytest.mark.parametrize("change, words", [
    ({"device_type": "cuda"}, "on a GPU the step's compiled functions run as CUDA graphs"),
    ({"distributed": True}, "under ddp and fsdp"),
    ({"accum": 4}, "loop.grad_accum_steps=4: each micro-batch is compiled"),
    ({"optimizer": Plain}, "Plain creates its state in its first step; give it a preinitialize() method"),
    ({"hooked": ["on_after_backward (plugin spy)"]}, "a plugin implements on_after_backward (plugin spy)"),
    ({"repeated": "4 x Block"}, "the model repeats a block (4 x Block): each block is compiled once for every "
                                "layer, so the first compile stays short however deep the model "
                                "(backend.compile_whole_step=true traces the whole step"),
])
def test_the_whole_step_is_refused_with_the_reason_and_the_fix(change, words):
    # a single CPU process stepping AdamW without in-step hooks: one graph (on a torch without standalone_compile,
    # the one reason left is that torch)
    assert refusal(**WHOLE) == needs_torch("one graph for the whole step", STANDALONE_TORCH)
    assert words in refusal(**{**WHOLE, **change})


def test_a_static_step_past_max_graphs_hands_back_none_for_a_new_shape_and_keeps_the_known_ones():
    """``StaticStep.prepare`` tells its caller that a shape is one graph too many by returning ``None`` (the
    whole step then runs that batch eagerly), not by raising."""
    def double(x):
        return x * 2

    steps = StaticStep(double, "double", retrace=False, cache=None, keyed=True, max_graphs=1)
    first = steps.prepare((torch.ones(2),), {}, iteration=1)
    assert first is not None and steps.execute(first, 0).tolist() == [2.0, 2.0]
    assert steps.prepare((torch.ones(3),), {}, iteration=2) is None
    again = steps.prepare((torch.full((2,), 3.0),), {}, iteration=3)
    assert again is not None and steps.execute(again, 1).tolist() == [6.0, 6.0]


def test_on_a_cpu_torchs_optimizers_with_a_fused_kernel_update_eagerly_and_others_compile():
    """``fused_on_cpu``: torch's Adam, AdamW, SGD and Adagrad (and a subclass keeping torch's ``step``) run their
    fused kernel eagerly on a CPU; not on a GPU, not an optimizer of another ``step``, not sparse gradients."""
    from csframework.backends.compile.update import fused_on_cpu, prepare_optimizer

    class GroupedAdamW(torch.optim.AdamW):  # keeps torch's step
        pass

    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    model = torch.nn.Linear(3, 2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, GroupedAdamW):
        assert fused_on_cpu(cls(model.parameters(), lr=0.1), cpu, model), cls
        assert not fused_on_cpu(cls(model.parameters(), lr=0.1), cuda, model), cls
    assert not fused_on_cpu(torch.optim.RMSprop(model.parameters(), lr=0.1), cpu, model)  # no fused kernel
    assert not fused_on_cpu(OwnStep(model.parameters(), lr=0.1), cpu, model)
    sparse = torch.nn.Embedding(4, 2, sparse=True)
    assert not fused_on_cpu(torch.optim.SGD(sparse.parameters(), lr=0.1), cpu, sparse)
    # prepared (again after a checkpoint brings back its saved settings): fused, a tensor rate, and it steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    prepare_optimizer(optimizer, cpu, fused=True)
    group = optimizer.param_groups[0]
    assert group["fused"] is True and group["foreach"] is False and group["capturable"] is False
    assert isinstance(group["lr"], torch.Tensor)
    model(torch.ones(1, 3)).sum().backward()
    before = model.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.weight)
