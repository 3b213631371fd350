"""``backend.compile=true`` (``csframework.backends.compile``): the settings, the same numbers as eager, graph
breaks and recompilations reported, the fallback, ``summary.json``'s ``compile`` block.

Compiling is slow on 2 cores; the runs use the tiny Blobs MLP and Inductor's cache (``~/.cache/csframework/
inductor``), so after the first run of the suite a run compiles from it in seconds. Runs several tests read are
made once per module.
"""
from __future__ import annotations

import inspect
import json
import os
import re

import pytest
import torch
from torch import nn

import csframework as csf
from csframework.errors import ConfigError, ValidationError
from fixtures import compose

pytestmark = pytest.mark.slow

COMPILE = "backend.compile=true"
#: 20 SGD steps on the Blobs MLP, evaluated at the end
STEPS = ["loop.max_steps=20", "loop.log_every=5", "backend.threads=1"]


def fit(tmp_path, *overrides, plugins=(), name="run") -> tuple[csf.Run, dict]:
    run = csf.Run(compose(*STEPS, *overrides), plugins=list(plugins), output_dir=tmp_path / name)
    return run, run.fit()


def params(run: csf.Run) -> dict:
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An eager run and two identical compiled runs of the same 20 steps."""
    tmp = tmp_path_factory.mktemp("compile")
    eager, _ = fit(tmp, name="eager")
    first, summary = fit(tmp, COMPILE, name="compiled")
    second, _ = fit(tmp, COMPILE, name="again")
    return {"eager": params(eager), "compiled": params(first), "again": params(second), "summary": summary,
            "dir": tmp / "compiled"}


# -- settings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, problem", [
    ("backend.compile_mode=fast", "backend.compile_mode: 'fast' is not one of default, reduce-overhead, max-autotune"),
    ("backend.compile_mode=max-autotune", "backend.compile_mode: it applies with backend.compile=true"),
    ("backend.compile_fullgraph=true", "backend.compile_fullgraph: it applies with backend.compile=true"),
    ("backend.compile_whole_step=false", "backend.compile_whole_step: it applies with backend.compile=true"),
])
def test_compile_settings_are_checked_naming_the_key(override, problem):
    with pytest.raises(ValidationError) as e:
        csf.Run(compose(override))
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_compile_is_refused_on_csx_naming_the_csx_setting():
    with pytest.raises(ValidationError) as e:
        compose("device=csx", COMPILE)
    assert e.value.problems == [
        "backend.compile: only CPU/GPU understands it, and this run's device is CSX; CSX always traces and compiles "
        "the whole step; remove it (backend.graph_compiler=inductor compiles the traced graph to host code, none "
        "interprets it)"]


def test_a_stage_may_compile(tmp_path):
    run = csf.Run(compose("loop.max_steps=2", "+stages={warm: {loop: {max_steps: 1}}, "
                          "main: {backend: {compile: true, compile_mode: reduce-overhead}}}"), output_dir=tmp_path)
    assert [cfg.backend.compile for _, cfg in run.stages] == [False, True]
    assert run.stages[1][1].backend.compile_mode == "reduce-overhead"


# -- the same numbers ----------------------------------------------------------------------------------------
def test_compiled_parameters_agree_with_eager_after_20_sgd_steps(runs):
    assert max_difference(runs["eager"], runs["compiled"]) < 1e-5


def test_two_compiled_runs_are_bit_identical(runs):
    assert all(torch.equal(runs["compiled"][k], runs["again"][k]) for k in runs["compiled"])


def test_summary_has_the_compile_block(runs):
    block = json.loads((runs["dir"] / "summary.json").read_text())["compile"]
    assert block == runs["summary"]["compile"]
    assert set(block) == {"mode", "seconds", "cache", "graph_breaks", "recompiles", "graph"}
    assert block["mode"] == "default" and block["cache"] in ("hit", "miss") and block["seconds"] > 0
    assert block["graph"] == "whole step"  # one CPU process, SGD, no plugin inside the step: one graph
    assert block["graph_breaks"] == 0 and block["recompiles"] == 0
    # issue 39 item 5: each step_compiled line's seconds are that function's own compile time (they add up to
    # the block's), and summary.json's compile_seconds is that time, which its steps_per_sec leaves out
    compiled = [json.loads(line) for line in (runs["dir"] / "events.jsonl").read_text().splitlines()
                if '"event": "step_compiled"' in line]
    assert compiled and sum(e["seconds"] for e in compiled) == pytest.approx(block["seconds"], abs=1e-3 * len(compiled))
    summary = json.loads((runs["dir"] / "summary.json").read_text())
    assert summary["compile_seconds"] == pytest.approx(block["seconds"], abs=1e-3)


@pytest.mark.parametrize("how, graph", [((), "per function"), (("backend.compile_whole_step=true",), "whole step")])
def test_the_default_transformer_agrees_with_eager_after_20_sgd_steps(tmp_path, how, graph):
    """A model of repeated blocks is compiled per function by default (each block once), or as one graph."""
    common = ["loop.max_steps=20", "loop.log_every=5", "loop.eval_every=null", "backend.threads=1", "optimizer=sgd",
              "optimizer.lr=0.1", "optimizer.schedule.warmup_steps=0"]
    eager = csf.Run(csf.compose(common), output_dir=tmp_path / "eager")
    eager.fit()
    compiled = csf.Run(csf.compose([*common, COMPILE, *how]), output_dir=tmp_path / "compiled")
    summary = compiled.fit()
    assert summary["compile"]["graph"] == graph and summary["compile"]["graph_breaks"] == 0
    assert max_difference(params(eager), params(compiled)) < 1e-5


def test_adamw_with_clipping_and_a_changing_rate_agrees_with_eager_as_one_graph(tmp_path):
    adamw = ["optimizer=adamw", "optimizer.lr=0.01", "optimizer.max_grad_norm=0.5", "optimizer.schedule.warmup_steps=5"]
    eager, _ = fit(tmp_path, *adamw, name="eager")
    compiled, summary = fit(tmp_path, COMPILE, *adamw, name="compiled")
    assert summary["compile"]["graph"] == "whole step"
    assert max_difference(params(eager), params(compiled)) < 1e-5


class InStepHook:
    """A plugin inside the step: it must run at every step, so the step is not traced once into a graph."""
    name = "in_step"

    def __init__(self):
        self.calls = 0

    @csf.hookimpl
    def on_after_backward(self):
        self.calls += 1


def test_a_plugin_inside_the_step_runs_every_step_with_the_functions_compiled(tmp_path, runs):
    hook = InStepHook()
    run, summary = fit(tmp_path, COMPILE, plugins=[hook])
    assert hook.calls == 20 and summary["compile"]["graph"] == "per function"
    assert max_difference(runs["eager"], params(run)) < 1e-5


def test_compile_whole_step_false_compiles_the_functions_with_the_same_numbers(tmp_path, runs):
    run, summary = fit(tmp_path, COMPILE, "backend.compile_whole_step=false")
    assert summary["compile"]["graph"] == "per function"
    assert max_difference(runs["eager"], params(run)) < 1e-5


def test_grad_accumulation_compiles_the_micro_batch(tmp_path):
    accum = ["loop.grad_accum_steps=2", "optimizer=adamw", "optimizer.lr=0.01", "optimizer.max_grad_norm=0.5"]
    eager, _ = fit(tmp_path, *accum, name="eager")
    compiled, summary = fit(tmp_path, COMPILE, *accum, name="compiled")
    assert max_difference(params(eager), params(compiled)) < 1e-5
    assert summary["compile"]["recompiles"] == 0


def test_bfloat16_autocast_runs_compiled(tmp_path):
    eager, _ = fit(tmp_path, "precision=bfloat16", name="eager")
    compiled, summary = fit(tmp_path, COMPILE, "precision=bfloat16", name="compiled")
    # bfloat16 products round differently once fused: close, not equal
    assert max_difference(params(eager), params(compiled)) < 2e-2
    assert summary["status"] == "completed" and summary["compile"]["graph_breaks"] == 0


class Collected:
    """Keeps ``run.eval_outputs`` of every evaluation (the output collector's result)."""
    name = "collected"

    def __init__(self):
        self.seen: list[dict] = []

    @csf.hookimpl
    def on_eval_end(self, run):
        self.seen.append({k: v.clone() for k, v in run.eval_outputs.items()})


def test_the_output_collector_gathers_the_compiled_evaluation_as_the_eager_one(tmp_path):
    # 61 validation samples in batches of 5: the last batch of 1 is a new shape for the compiled evaluation
    common = ["loop.collect=[preds,labels,logits]", "data.val.n=61", "data.eval_batch_size=5", "loop.eval_every=10"]
    kept = {name: Collected() for name in ("eager", "compiled")}
    fit(tmp_path, *common, plugins=[kept["eager"]], name="eager")
    _, summary = fit(tmp_path, COMPILE, *common, plugins=[kept["compiled"]], name="compiled")
    assert summary["status"] == "completed" and summary["compile"]["graph_breaks"] == 0
    assert len(kept["compiled"].seen) == len(kept["eager"].seen) == 2
    for eager, compiled in zip(kept["eager"].seen, kept["compiled"].seen):
        assert torch.equal(compiled["labels"], eager["labels"]) and compiled["logits"].shape == (61, 4)
        assert torch.equal(compiled["preds"], compiled["logits"].argmax(-1))
        assert float((compiled["logits"] - eager["logits"]).abs().max()) < 1e-5


#: float16 with a first loss scale that overflows: the first 6 of 12 steps are skipped, the scale halving each time
OVERFLOWING = ["precision=float16", "precision.init_scale=4194304", "loop.max_steps=12", "optimizer=adamw",
               "optimizer.lr=0.01", "loop.log_every=4"]


def test_float16_loss_scaling_skips_overflowing_steps_inside_the_whole_step_graph(tmp_path):
    eager, _ = fit(tmp_path, *OVERFLOWING, name="eager")
    compiled, summary = fit(tmp_path, COMPILE, *OVERFLOWING, name="compiled")
    assert summary["compile"]["graph"] == "whole step" and summary["compile"]["recompiles"] == 0
    # the same 6 steps skipped (no step count, no update) and the same scale, without GradScaler
    assert compiled.backend.loss_scale() == eager.backend.loss_scale() == 4194304 / 2 ** 6
    assert {float(state["step"]) for state in compiled.optimizer.state.values()} == {6.0}
    # float16 products round differently once fused: close, not equal
    assert max_difference(params(eager), params(compiled)) < 1e-3
    # the checkpoint keeps GradScaler's keys and values: it resumes an eager run as well
    state = compiled.state_dict()["backend"]["precision"]
    assert state == eager.state_dict()["backend"]["precision"]


def test_float16_loss_scaling_skips_overflowing_steps_in_the_compiled_update(tmp_path):
    """The step's functions compiled (as on a GPU): the update, compiled, skips the overflowing steps itself."""
    eager, _ = fit(tmp_path, *OVERFLOWING, name="eager")
    compiled, summary = fit(tmp_path, COMPILE, "backend.compile_whole_step=false", *OVERFLOWING, name="compiled")
    assert summary["compile"]["graph"] == "per function" and compiled.backend.compiled.update == "compiled"
    assert summary["compile"]["recompiles"] == 0  # one graph of the update, whatever the learning rate
    assert compiled.backend.loss_scale() == eager.backend.loss_scale() == 4194304 / 2 ** 6
    assert {float(state["step"]) for state in compiled.optimizer.state.values()} == {6.0}
    assert max_difference(params(eager), params(compiled)) < 1e-3
    # the optimizer keeps its fused setting: the checkpoint resumes an eager run as it was built
    assert all(group["fused"] for group in compiled.optimizer.param_groups)


def test_a_float16_whole_step_run_resumes_exactly_with_its_loss_scale(tmp_path):
    straight, _ = fit(tmp_path, COMPILE, *OVERFLOWING, name="straight")
    # stopped after 4 steps, all skipped so far: the scale is what resumes
    first, _ = fit(tmp_path, COMPILE, *OVERFLOWING, "loop.max_steps=4", name="first")
    resumed = csf.Run(compose(*STEPS, COMPILE, *OVERFLOWING), output_dir=tmp_path / "resumed")
    resumed.load_state_dict(first.state_dict())
    assert resumed.backend.loss_scale() == 4194304 / 2 ** 4
    assert resumed.fit()["global_step"] == 12
    a, b = params(straight), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.backend.loss_scale() == straight.backend.loss_scale()


# -- graph breaks, recompilations, failures ------------------------------------------------------------------
class ItemNet(nn.Module):
    """A model whose forward reads a value on the host: a graph break."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 4)

    def forward(self, batch):
        x, y = batch
        logits = self.net(x)
        if logits.mean().item() > 100:  # the graph break this test expects
            logits = logits * 0
        return nn.functional.cross_entropy(logits, y)


_lines, _first = inspect.getsourcelines(ItemNet.forward)
BREAK_LINE = _first + next(i for i, line in enumerate(_lines) if ".item()" in line)


def item_net():
    return ItemNet()


class Warnings:
    name = "warnings"

    def __init__(self):
        self.events = []

    @csf.hookimpl
    def on_fit_start(self, run):
        log = run.log

        class Spy:
            def __getattr__(spy, level):
                method = getattr(log, level)

                def call(event, **kw):
                    self.events.append((level, event, kw))
                    return method(event, **kw)
                return call

        run.log = Spy()


#: a log line of torch's own (glog format: ``W1127 20:51:06.471000 15100 torch/_dynamo/...``)
TORCH_LOG_LINE = re.compile(r"^[DIWEC]\d{4} \d\d:\d\d:\d\d")


def test_a_graph_break_is_warned_once_with_the_users_line_and_recompiles_at_most_once(tmp_path, capfd):
    spy = Warnings()
    run = csf.Run(compose(*STEPS, COMPILE, f"model._target_={__name__}.item_net", "~model.net", "~model.loss"),
                  plugins=[spy], output_dir=tmp_path)
    summary = run.fit()
    warnings = [(event, kw) for level, event, kw in spy.events if level == "warning"]
    assert [event for event, _ in warnings] == ["graph_break"], warnings
    found = warnings[0][1]
    assert found["where"] == f"{__file__}:{BREAK_LINE}"
    assert "`.item()` reads a tensor's value" in found["problem"] and "fix:" in found["problem"]
    assert "logits.mean().item() > 100" in found["problem"]  # the user's code, as on CSX
    assert summary["compile"]["graph_breaks"] == 1 and summary["status"] == "completed"
    # the value read becomes a guard of the code after the break: one recompilation, then the forward runs
    # eagerly (before: one per step until torch's own limit, and torch's multi-line warning on stderr)
    assert summary["compile"]["recompiles"] <= 1, run.backend.compiled.recompiles
    assert not [line for line in capfd.readouterr().err.splitlines() if TORCH_LOG_LINE.match(line)]
    torch_logs = [kw for _, event, kw in spy.events if event == "torch_log"]
    assert all(kw["console"] is False for kw in torch_logs)  # torch's own lines: events.jsonl only
    # the step did not trace into one graph: its functions were compiled, the break reported by Dynamo
    assert summary["compile"]["graph"] == "per function"
    assert [event for _, event, _ in spy.events if event == "step_compiled_per_function"] == ["step_compiled_per_function"]


def test_compile_fullgraph_refuses_a_graph_break_before_any_step(tmp_path):
    run = csf.Run(compose(*STEPS, COMPILE, "backend.compile_fullgraph=true", f"model._target_={__name__}.item_net",
                          "~model.net", "~model.loss"), output_dir=tmp_path)
    before = params(run)
    with pytest.raises(ConfigError, match=r"backend.compile_fullgraph: the step does not compile into one graph: "
                                          + f".*{__file__}:{BREAK_LINE}") as e:
        run.fit()
    # the construct and the fix in plain words, not Dynamo's "Could not guard on data-dependent expression zuf0"
    assert "`if logits.mean().item() > 100:" in str(e.value)
    assert "`.item()` reads a tensor's value on the host; fix: keep the value a tensor" in str(e.value)
    assert "zuf0" not in str(e.value)
    assert run.global_step == 0 and all(torch.equal(before[k], v) for k, v in params(run).items())


def test_the_short_last_batch_recompiles_once_not_every_epoch(tmp_path):
    # 200 samples in batches of 16: 12 full batches and one of 8 per epoch, 3 epochs
    run, summary = fit(tmp_path, COMPILE, "data.train.n=200", "data.drop_last=false", "loop.max_steps=null",
                       "loop.max_epochs=3")
    assert summary["global_step"] == 39
    assert summary["compile"]["recompiles"] == 1  # the step, for the short batch, in the first epoch only
    assert run.backend.compiled.recompiles == ["train_step: new input shapes (((8, 8), 'float32'), ((8,), 'int64')) "
                                               "(compiled for (((16, 8), 'float32'), ((16,), 'int64')))"]


def test_a_failed_compile_goes_on_eagerly_with_one_warning(tmp_path, monkeypatch):
    import torch._inductor
    import torch._inductor.compile_fx as compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    # both mechanisms (the whole step's graph, and torch.compile's functions for evaluation) fail to compile;
    # an empty cache, so that nothing compiled earlier is loaded instead
    monkeypatch.setattr(compile_fx, "compile_fx", broken)
    monkeypatch.setattr(torch._inductor, "standalone_compile", broken)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    spy = Warnings()
    run = csf.Run(compose(*STEPS, COMPILE), plugins=[spy], output_dir=tmp_path / "compiled")
    summary = run.fit()
    failures = [kw for level, event, kw in spy.events if event == "compile_failed"]
    assert len(failures) == 1 and "no C++ compiler found" in failures[0]["problem"]
    assert summary["status"] == "completed" and "no C++ compiler found" in summary["compile"]["fallback"]
    monkeypatch.undo()
    eager, _ = fit(tmp_path, name="eager")
    assert max_difference(params(eager), params(run)) == 0


# -- any optimizer, a schedule never recompiles ---------------------------------------------------------------
class GroupedAdamW(torch.optim.AdamW):
    """A user's AdamW that sets its own weight-decay groups (nanoGPT's ``configure_optimizers``): it takes plain
    parameters, which a ``_target_`` optimizer gets when csframework makes one group of them
    (``optimizer.weight_decay_exclude=[]``)."""

    def __init__(self, params, lr=1e-3, weight_decay=0.0):
        params = list(params)
        super().__init__([{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
                          {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}], lr=lr)


class SignMomentum(torch.optim.Optimizer):
    """A user's optimizer (not torch's): its step reads ``group["lr"]`` as a number and creates its state lazily."""

    def __init__(self, params, lr=1e-3, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(0.9).add_(p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(state["momentum"].sign(), alpha=-group["lr"])


#: a learning rate that changes at every step: 5 steps of warm-up, then a cosine decay
WARMUP_COSINE = ["optimizer.lr=0.01", "optimizer.weight_decay=0.1", "optimizer.schedule.name=cosine",
                 "optimizer.schedule.warmup_steps=5", "optimizer.schedule.min_lr=0.001", "loop.max_steps=12",
                 "loop.log_every=4"]


@pytest.mark.parametrize("optimizer, extra, graph", [
    ("GroupedAdamW", [], "whole step"),  # torch's update: traced with the step as AdamW's is
    ("GroupedAdamW", ["backend.compile_whole_step=false"], "per function"),  # torch's step, a tensor rate
    ("SignMomentum", [], "per function"),  # the user's step reads the rate, a tensor, as a number
])
def test_a_user_optimizer_under_warmup_and_cosine_never_recompiles(tmp_path, optimizer, extra, graph):
    common = [*WARMUP_COSINE, f"+optimizer._target_={__name__}.{optimizer}",
              *(["optimizer.weight_decay_exclude=[]"] if optimizer == "GroupedAdamW" else [])]
    eager, _ = fit(tmp_path, *common, name="eager")
    spy = Warnings()
    compiled, summary = fit(tmp_path, COMPILE, *common, *extra, plugins=[spy], name="compiled")
    assert summary["compile"]["graph"] == graph
    # before: the float rate was a guard of the compiled update, recompiled at each of the 7 steps it changed
    assert summary["compile"]["recompiles"] == 0
    assert not [kw for _, event, kw in spy.events if event in ("recompiled", "recompile_limit")]
    assert max_difference(params(eager), params(compiled)) < 1e-5
    if optimizer == "SignMomentum":  # why the step is not one graph, and the fix: one line
        reasons = [kw["reason"] for _, event, kw in spy.events if event == "step_compiled_per_function"]
        assert reasons == [f"optimizer {__name__}.SignMomentum creates its state in its first step; give it a "
                           "preinitialize() method that creates the state (torch's layout) to make the step one "
                           "graph"]


# -- settings, plainly ------------------------------------------------------------------------------------------
def test_reduce_overhead_on_a_cpu_says_what_it_does_there(tmp_path):
    spy = Warnings()
    fit(tmp_path, COMPILE, "backend.compile_mode=reduce-overhead", "loop.max_steps=2", plugins=[spy])
    notes = [kw for _, event, kw in spy.events if event == "compile_mode"]
    assert notes == [{"mode": "reduce-overhead", "result": "on a CPU it compiles as default does: its CUDA graphs "
                                                           "(the launch overhead it saves) exist on a GPU only"}]


# -- a library, not the owner of the process --------------------------------------------------------------------
def _process_settings() -> dict:
    import logging

    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    from csframework.compat import recompile_limit_key

    return {"cache_env": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            "recompile_limit": getattr(dynamo_config, recompile_limit_key()),
            "vec_isa_ok": inductor_config.cpp.vec_isa_ok,
            "torch_handlers": list(logging.getLogger("torch._dynamo").handlers)}


def test_a_compiled_fit_leaves_the_callers_compiled_functions_and_settings_alone(tmp_path):
    """As in a notebook: the caller's function compiled before ``fit()`` is not compiled again after it, and the
    process-wide settings (Inductor's cache, Dynamo's limit, the vector-instruction check, torch's log handlers)
    read the same."""
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    @torch.compile(backend=counting)
    def users(x):
        return torch.sin(x) * 2

    x = torch.randn(4)
    users(x)
    before = _process_settings()
    # (backend.threads=0: torch's thread count, which a run's backend.threads sets, is a guard of every compiled
    # function; the compile settings are this test's subject)
    _, summary = fit(tmp_path, COMPILE, "loop.max_steps=3", "backend.threads=0")
    assert summary["compile"]["graph"] == "whole step"
    _, summary = fit(tmp_path, COMPILE, "backend.compile_whole_step=false", "loop.max_steps=3", "backend.threads=0",
                     name="functions")
    assert summary["compile"]["graph"] == "per function"
    users(x)
    assert len(compiles) == 1  # before: torch._dynamo.reset() in every compiled run dropped it
    assert _process_settings() == before
