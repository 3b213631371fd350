"""``csframework.backends.csx.backend`` (with the tracer, graph and compiler it drives).

The CSX emulator behind ``device=csx`` (issue 3): static-graph semantics, parity with eager CPU, tracing
and compile errors, step closures, compile_only / validate_only, cbfloat16."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import csframework as csf
import fixtures
from csframework.models import Supervised
from csx_runs import max_diff, params_of, run_on

ROOT = Path(__file__).resolve().parents[2]


def line_of(marker: str) -> int:
    for number, line in enumerate(Path(__file__).read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(marker)


# -- models used by the tests (importable as test_csx_backend.<name> by Hydra) ------------------------------------

class Counting(Supervised):
    """Counts and prints every Python execution of its training forward."""

    calls = 0

    def forward(self, batch):
        if self.training:
            type(self).calls += 1
            print(f"counting forward {type(self).calls}")
        return super().forward(batch)


class Reading(Supervised):
    """Reads a tensor value in forward in one of the ways a static graph cannot express."""

    read = "if"

    def forward(self, batch):
        out = super().forward(batch)
        loss, mode = out["loss"], type(self).read
        if mode == "if":
            if loss > 0:  # READ-IF
                out["loss"] = loss * 1.0
        elif mode == "item":
            out["seen"] = loss.item()  # READ-ITEM
        elif mode == "tolist":
            out["seen"] = out["logits"].tolist()  # READ-TOLIST
        elif mode == "cpu":
            out["seen"] = loss.cpu()  # READ-CPU
        elif mode == "mask":
            out["seen"] = out["logits"][out["logits"] > 0].sum()  # READ-MASK
        return out


class Changing(Supervised):
    """Its operations change from the third training forward on (a Python branch on a Python counter)."""

    calls = 0

    def forward(self, batch):
        out = super().forward(batch)
        if self.training:
            type(self).calls += 1
            if type(self).calls >= 3:
                out["loss"] = out["loss"] * 2.0  # CHANGES
        return out


class WithClosure(Supervised):
    """Hands the loss and a logits statistic to a step closure every training step."""

    seen: list = []

    def forward(self, batch):
        out = super().forward(batch)
        if self.training:
            record(out["loss"], out["logits"].abs().mean())
        return out


@csf.step_closure
def record(loss, stat):
    assert isinstance(loss, torch.Tensor) and not loss.requires_grad
    WithClosure.seen.append((loss.item(), stat.item()))


class Counter:
    """A plugin counting hook calls."""

    name = "counter"

    def __init__(self):
        self.counts: dict[str, int] = {}

    def _count(self, hook):
        self.counts[hook] = self.counts.get(hook, 0) + 1

    @csf.hookimpl
    def on_before_backward(self, run, loss):
        self._count("on_before_backward")

    @csf.hookimpl
    def on_after_backward(self, run):
        self._count("on_after_backward")

    @csf.hookimpl
    def on_before_optimizer_step(self, run, optimizer):
        self._count("on_before_optimizer_step")

    @csf.hookimpl
    def on_train_batch_end(self, run):
        self._count("on_train_batch_end")


# -- static-graph semantics --------------------------------------------------------------------------------

def test_one_trace_without_retrace_and_one_per_step_with_it(tmp_path):
    run, summary = run_on("csx", tmp_path, "loop.max_steps=6")
    assert summary["device_type"] == "CSX" and summary["status"] == "completed"
    assert summary["traces"] == 1 and summary["executions"] == 6
    assert summary["global_step"] == 6
    on_disk = json.loads((tmp_path / "csx" / "summary.json").read_text())
    assert on_disk["traces"] == 1 and on_disk["device_type"] == "CSX"
    _, summary = run_on("csx", tmp_path, "loop.max_steps=6", "backend.retrace_every_iteration=true", name="re")
    assert summary["traces"] == 6 and summary["executions"] == 6


@pytest.mark.parametrize("device, retrace, expected", [("csx", False, 1), ("csx", True, 5), ("cpu", False, 5)])
def test_python_side_effects_run_once_per_trace(tmp_path, capsys, device, retrace, expected):
    Counting.calls = 0
    overrides = ["loop.max_steps=5", "model._target_=test_csx_backend.Counting", "data.val=null"]
    if retrace:
        overrides.append("backend.retrace_every_iteration=true")
    _, summary = run_on(device, tmp_path, *overrides)
    assert summary["global_step"] == 5
    assert Counting.calls == expected
    assert capsys.readouterr().out.count("counting forward") == expected


@pytest.mark.parametrize("optimizer", [
    ["optimizer=adamw", "optimizer.lr=0.02", "optimizer.max_grad_norm=0.5"],
    ["optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9", "optimizer.weight_decay=0.01",
     "loop.grad_accum_steps=2"],
    ["optimizer=adam", "optimizer.lr=0.01", "optimizer.weight_decay=0.01"],
], ids=["adamw-clip", "sgd-momentum-accum", "adam-l2"])
def test_parity_with_eager_cpu(tmp_path, optimizer):
    """Same model, data, seed, float32, cosine schedule with warm-up: 50 steps on csx and cpu agree."""
    common = ["loop.max_steps=50", "loop.log_every=10", "optimizer.schedule.name=cosine",
              "optimizer.schedule.warmup_steps=5", "optimizer.schedule.min_lr=0.001", "precision=float32",
              *optimizer]
    cpu, cpu_summary = run_on("cpu", tmp_path, *common)
    csx, csx_summary = run_on("csx", tmp_path, *common)
    assert csx_summary["traces"] == 1
    assert max_diff(params_of(cpu), params_of(csx)) <= 1e-5
    before = params_of(csx)
    assert max_diff(before, {k: torch.zeros_like(v) for k, v in before.items()}) > 0.1  # it did train
    # the schedule ran on both: same learning rate at the end, same logged losses and validation metrics
    assert csx.optimizer.param_groups[0]["lr"] == pytest.approx(cpu.optimizer.param_groups[0]["lr"], rel=1e-12)
    for key in ("train/loss", "val/loss", "val/accuracy"):
        assert csx_summary["metrics"][key] == pytest.approx(cpu_summary["metrics"][key], abs=1e-5)
    cpu_state, csx_state = cpu.optimizer.state_dict()["state"], csx.optimizer.state_dict()["state"]
    for index, entry in cpu_state.items():
        for key, value in entry.items():
            assert torch.allclose(torch.as_tensor(value), torch.as_tensor(csx_state[index][key]), atol=1e-5), key


def test_hooks_inside_the_step_run_at_trace_time_only(tmp_path):
    counter = Counter()
    _, summary = run_on("csx", tmp_path, "loop.max_steps=4", plugins=[counter])
    assert summary["traces"] == 1
    assert counter.counts == {"on_before_backward": 1, "on_after_backward": 1, "on_before_optimizer_step": 1,
                              "on_train_batch_end": 4}


# -- tracing errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, marker, needle", [
    ("if", "READ-IF", "control flow"), ("item", "READ-ITEM", ".item()"), ("tolist", "READ-TOLIST", ".tolist()"),
    ("cpu", "READ-CPU", ".cpu()"), ("mask", "READ-MASK", "output shape depends on tensor values")])
def test_reading_tensor_values_is_a_tracing_error_naming_the_line(tmp_path, mode, marker, needle):
    Reading.read = mode
    overrides = ["loop.max_steps=3", "model._target_=test_csx_backend.Reading"]
    with pytest.raises(csf.TracingError) as info:
        run_on("csx", tmp_path, *overrides)
    message = str(info.value)
    assert f"test_csx_backend.py:{line_of(marker)}" in message, message
    assert needle in message
    assert "torch.where" in message or "step_closure" in message
    _, summary = run_on("cpu", tmp_path, *overrides)  # the same code runs eagerly
    assert summary["status"] == "completed" and summary["global_step"] == 3


def test_a_graph_that_changes_under_retrace_is_a_compile_error_naming_the_iteration(tmp_path):
    Changing.calls = 0
    overrides = ["loop.max_steps=5", "model._target_=test_csx_backend.Changing", "data.val=null"]
    cfg = fixtures.compose("device=csx", f"backend.compile_dir={tmp_path}/c", "backend.retrace_every_iteration=true",
                           *overrides)
    run = csf.Run(cfg, output_dir=tmp_path / "re")
    with pytest.raises(csf.CompileError) as info:
        run.fit()
    message = str(info.value)
    assert "iteration 3" in message and "aten.mul" in message, message
    assert f"test_csx_backend.py:{line_of('CHANGES')}" in message
    assert run.global_step == 2  # stopped before executing the changed graph
    assert run.backend.train_step.executions == 2
    Changing.calls = 0  # without retrace the first graph runs every step
    _, summary = run_on("csx", tmp_path, *overrides, name="once")
    assert summary["status"] == "completed" and summary["traces"] == 1


# -- step closures -------------------------------------------------------------------------------------------

def test_step_closures_get_each_steps_values_as_on_cpu(tmp_path):
    overrides = ["loop.max_steps=7", "loop.log_every=1", "model._target_=test_csx_backend.WithClosure",
                 "optimizer.lr=0.2"]
    WithClosure.seen = []
    cpu, _ = run_on("cpu", tmp_path, *overrides)
    eager = list(WithClosure.seen)
    WithClosure.seen = []
    csx, summary = run_on("csx", tmp_path, *overrides)
    assert summary["traces"] == 1 and len(WithClosure.seen) == 7 == len(eager)
    assert len({loss for loss, _ in eager}) == 7  # the values change step to step
    for (a_loss, a_stat), (b_loss, b_stat) in zip(eager, WithClosure.seen):
        assert b_loss == pytest.approx(a_loss, abs=1e-6) and b_stat == pytest.approx(a_stat, abs=1e-6)
    # the built-in metrics plugin got every step's loss through the backend's own step closure
    rows = [line.split(",") for line in (tmp_path / "csx" / "metrics.csv").read_text().splitlines()[1:]]
    losses = [float(r[3]) for r in rows if r[2] == "train/loss"]
    assert losses == pytest.approx([loss for loss, _ in eager], abs=1e-6)


# -- modes and the compile cache ------------------------------------------------------------------------------

def test_validate_only_traces_and_executes_nothing(tmp_path):
    cfg = fixtures.compose("device=csx", f"backend.compile_dir={tmp_path}/c", "backend.validate_only=true")
    run = csf.Run(cfg, output_dir=tmp_path / "v")
    # the optimizer state exists before anything is traced (sgd with momentum: one buffer per parameter)
    buffers = [run.optimizer.state[p]["momentum_buffer"] for p in run.model.parameters()]
    assert len(buffers) == 4 and all(not b.any() for b in buffers)
    before = params_of(run)
    summary = run.fit()
    assert summary["status"] == "validated" and summary["traces"] == 1 and summary["executions"] == 0
    assert summary["global_step"] == 0
    after = params_of(run)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not (tmp_path / "v" / "checkpoints").exists()
    assert json.loads((tmp_path / "v" / "summary.json").read_text())["status"] == "validated"


def test_validate_only_still_finds_tracing_errors(tmp_path):
    Reading.read = "item"
    cfg = fixtures.compose("device=csx", f"backend.compile_dir={tmp_path}/c", "backend.validate_only=true",
                           "model._target_=test_csx_backend.Reading")
    with pytest.raises(csf.TracingError, match="READ-ITEM|loss.item"):
        csf.Run(cfg, output_dir=tmp_path / "v").fit()


def test_compile_only_writes_the_report_trains_nothing_and_hits_the_cache(tmp_path):
    def compile_run(name):
        cfg = fixtures.compose("device=csx", f"backend.compile_dir={tmp_path}/cache", "backend.compile_only=true",
                               "optimizer=adamw")
        run = csf.Run(cfg, output_dir=tmp_path / name)
        before = params_of(run)
        summary = run.fit()
        after = params_of(run)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert summary["status"] == "compiled" and summary["executions"] == 0 and summary["global_step"] == 0
        assert not (tmp_path / name / "checkpoints").exists()
        return summary, json.loads((tmp_path / name / "compile_report.json").read_text())

    first, report = compile_run("one")
    assert first["compile_cache"] == "miss" and report["cache"]["status"] == "miss"
    assert report["fingerprint"] == first["graph_fingerprint"]
    assert report["ops"]["total"] > 10 and report["ops"]["by_kind"]["matmul"] >= 2
    params = 8 * 16 + 16 + 16 * 4 + 4
    memory = report["memory"]
    assert memory["parameter_bytes"] == 4 * params and memory["gradient_bytes"] == 4 * params
    assert memory["optimizer_state_bytes"] >= 2 * 4 * params  # adamw: two moments (+ step counters)
    assert memory["activation_bytes_estimate"] > 0
    assert (Path(report["cache"]["entry"]) / "graph.py").exists()
    second, report2 = compile_run("two")
    assert second["compile_cache"] == "hit" and report2["cache"]["status"] == "hit"
    assert report2["fingerprint"] == report["fingerprint"] and report2["compile_seconds"] == report["compile_seconds"]


def test_a_changed_batch_shape_is_a_compile_error_without_retrace(tmp_path):
    # 250 samples, batch 16, drop_last=false: the last batch of the epoch has 10 samples
    overrides = ["loop.max_steps=20", "data.drop_last=false", "data.train.n=250", "data.val=null"]
    with pytest.raises(csf.CompileError, match=r"iteration 16 .*shape \[16, 8\].*\[10, 8\].*drop_last"):
        run_on("csx", tmp_path, *overrides)


# -- precision -----------------------------------------------------------------------------------------------

def test_cbfloat16_trains_with_dynamic_loss_scaling(tmp_path):
    fp32, _ = run_on("csx", tmp_path, "loop.max_steps=20", name="fp32")
    cb, summary = run_on("csx", tmp_path, "loop.max_steps=20", "precision=cbfloat16", name="cb")
    assert summary["status"] == "completed" and summary["metrics"]["val/accuracy"] > 0.8
    diff = max_diff(params_of(fp32), params_of(cb))
    assert 0 < diff < 0.05  # CB16 rounding changes the numbers a little, not the training
    assert cb.backend.state_dict()["precision"]["scale"] == 65536.0


def test_cbfloat16_overflow_skips_the_step_and_backs_off_the_scale(tmp_path):
    cfg = fixtures.compose("device=csx", f"backend.compile_dir={tmp_path}/c", "precision=cbfloat16",
                           "precision.init_scale=1e30", "loop.max_steps=1", "data.val=null")
    run = csf.Run(cfg, output_dir=tmp_path / "o")
    before = params_of(run)
    run.fit()
    after = params_of(run)
    assert all(torch.equal(before[k], after[k]) for k in before)  # gradients overflowed CB16: step skipped
    assert run.backend.state_dict()["precision"]["scale"] == pytest.approx(0.5e30, rel=1e-6)
    cfg = fixtures.compose("device=csx", f"backend.compile_dir={tmp_path}/c", "precision=cbfloat16",
                           "precision.init_scale=1e30", "loop.max_steps=80", "data.val=null")
    run = csf.Run(cfg, output_dir=tmp_path / "o2")
    summary = run.fit()
    assert run.backend.state_dict()["precision"]["scale"] < 1e10  # backed off until finite
    assert summary["metrics"]["train/loss"] < 0.5
    assert all(torch.isfinite(v).all() for v in params_of(run).values())


def test_a_loss_scale_below_min_scale_stops_the_run(tmp_path):
    with pytest.raises(csf.NonFiniteLossError, match="min_scale"):
        run_on("csx", tmp_path, "precision=cbfloat16", "precision.init_scale=1e30", "precision.min_scale=1e25",
               "loop.max_steps=40", "data.val=null")


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_half_precisions_train_on_csx(tmp_path, precision):
    _, summary = run_on("csx", tmp_path, "loop.max_steps=12", f"precision={precision}")
    assert summary["status"] == "completed" and summary["traces"] == 1
    assert summary["metrics"]["train/loss"] < 1.2


# -- rules ---------------------------------------------------------------------------------------------------

def test_num_csx_must_be_between_one_and_the_batch_size(tmp_path):
    for value in (0, 17):
        with pytest.raises(csf.ValidationError, match="num_csx"):
            run_on("csx", tmp_path, f"backend.num_csx={value}")
    _, summary = run_on("csx", tmp_path, "backend.num_csx=4", "loop.max_steps=2")
    assert summary["num_csx"] == 4


def test_resume_on_csx_matches_an_uninterrupted_run(tmp_path):
    full, _ = run_on("csx", tmp_path, "loop.max_steps=10", "optimizer=adamw", "optimizer.schedule.name=constant",
                     "optimizer.schedule.warmup_steps=0", name="full")
    run_on("csx", tmp_path, "loop.max_steps=5", "optimizer=adamw", "optimizer.schedule.name=constant",
           "optimizer.schedule.warmup_steps=0", name="part")
    resumed, summary = run_on("csx", tmp_path, "loop.max_steps=10", "optimizer=adamw",
                              "optimizer.schedule.name=constant", "optimizer.schedule.warmup_steps=0",
                              "checkpoint.resume=auto", name="part")
    assert summary["global_step"] == 10
    assert max_diff(params_of(full), params_of(resumed)) <= 1e-6


# -- the CLI ------------------------------------------------------------------------------------------------

def cli(cli_env, tmp_path, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "csframework", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_cli_headline_command_retraces_every_step(tmp_path, cli_env):
    result = cli(cli_env, tmp_path, "device=csx", "backend.retrace_every_iteration=true", "loop.max_steps=30",
                 f"backend.compile_dir={tmp_path / 'compile'}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["device_type"] == "CSX" and summary["status"] == "completed"
    assert summary["traces"] == 30 and summary["global_step"] == 30
    assert (tmp_path / "run" / "compile_report.json").exists()


@pytest.mark.slow
def test_cli_tracing_error_is_one_clean_line(tmp_path, cli_env):
    result = cli(cli_env, tmp_path, "--config-dir", fixtures.CONF, *fixtures.TINY, "device=csx",
                 "model._target_=test_csx_backend.Reading", f"backend.compile_dir={tmp_path / 'compile'}")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("csframework: error:")]
    assert len(errors) == 1 and "TracingError" not in errors[0]
    assert f"test_csx_backend.py:{line_of('READ-IF')}" in errors[0] and "torch.where" in errors[0]


@pytest.mark.slow
def test_cli_cbfloat16_on_cpu_exits_2(tmp_path, cli_env):
    result = cli(cli_env, tmp_path, "precision=cbfloat16", "device=cpu", "loop.max_steps=1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cbfloat16 needs device=csx" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
