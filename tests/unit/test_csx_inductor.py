"""``csframework.graph.inductor``.

The CSX train step compiled with TorchInductor (``backend.graph_compiler=inductor``): the same numbers as
the interpreted graph, the compile cache across runs, retrace mode, the fallback with its one-line warning,
exact cbfloat16 rounding. Inductor compiles are slow (seconds per graph): the tests that compile are few, on
the tiny Blobs MLP, and marked ``slow``."""
from __future__ import annotations

import json
import re

import pytest
import torch

import csframework as csf
import fixtures
from csframework import compat
from csframework.backends.csx import lowlevel
from csframework.graph import inductor
from csframework.backends.csx.cbfloat16 import round_to_cbfloat16
from csframework.privatedir import PrivateDir
from csx_runs import max_diff, params_of, run_on
# the model whose error must name its line in test_csx_backend.py, and the finder of that line
from test_csx_backend import Changing, line_of

COMMON = ["loop.max_steps=12", "loop.log_every=1", "optimizer=adamw", "optimizer.lr=0.02",
          "optimizer.max_grad_norm=0.5", "optimizer.schedule.name=cosine", "optimizer.schedule.warmup_steps=3",
          "data.val=null"]


#: the tests that compile, or replace the compiler, need the torch that has it
needs_standalone_compile = pytest.mark.requires_torch(inductor.STANDALONE_TORCH, "torch._inductor.standalone_compile")


def train_losses(run_dir) -> list[float]:
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    out = []
    for row in rows[1:]:
        values = dict(zip(header, row.split(",")))
        if values.get("name") == "train/loss":
            out.append(float(values["value"]))
    return out


@pytest.mark.slow
@needs_standalone_compile
def test_compiled_step_matches_the_interpreted_graph_and_a_second_run_loads_it(tmp_path):
    """Inductor may reorder float operations (fused reductions, vectorised loops), so compiled and interpreted
    agree to float32 rounding, not bit for bit: 12 AdamW steps stay within 1e-5 (parameters) and 1e-5
    relative (losses). Two compiled runs from the same cache run the same code: bit-identical."""
    plain, plain_summary = run_on("csx", tmp_path, *COMMON, "backend.graph_compiler=none", name="plain")
    assert plain_summary["graph_compiler"] == "interpreted"
    before = inductor.compilations
    first, first_summary = run_on("csx", tmp_path, *COMMON, "backend.graph_compiler=inductor", name="first")
    assert first_summary["graph_compiler"] == "compiled" and inductor.compilations == before + 1
    report = json.loads((tmp_path / "first" / "compile_report.json").read_text())
    assert report["graph_compiler"]["name"] == "inductor" and report["graph_compiler"]["status"] == "compiled"
    assert max_diff(params_of(plain), params_of(first)) <= 1e-5
    plain_losses, first_losses = train_losses(tmp_path / "plain"), train_losses(tmp_path / "first")
    assert len(plain_losses) == 12
    assert first_losses == pytest.approx(plain_losses, rel=1e-5)
    assert max_diff(params_of(plain), {k: torch.zeros_like(v) for k, v in params_of(plain).items()}) > 0.1
    for index, entry in plain.optimizer.state_dict()["state"].items():  # the AdamW moments too
        for key, value in entry.items():
            other = first.optimizer.state_dict()["state"][index][key]
            assert torch.allclose(torch.as_tensor(value), torch.as_tensor(other), atol=1e-5), key

    second, second_summary = run_on("csx", tmp_path, *COMMON, "backend.graph_compiler=inductor", name="second")
    assert second_summary["graph_compiler"] == "loaded" and second_summary["compile_cache"] == "hit"
    assert inductor.compilations == before + 1  # loaded from the cache, not compiled again
    assert max_diff(params_of(first), params_of(second)) == 0
    assert train_losses(tmp_path / "second") == train_losses(tmp_path / "first")


@pytest.mark.slow
@needs_standalone_compile
def test_an_artifact_is_loaded_only_for_the_settings_and_torch_it_was_compiled_with(tmp_path, monkeypatch):
    """The cache entry of a graph keeps one artifact per Inductor settings and torch version: a graph compiled
    with other settings (another compile mode, or an older csframework's) is never loaded in its place."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: (x * 2).sum(0))(torch.randn(4, 3))
    entry = PrivateDir(tmp_path, "fingerprint")

    def status(patches):
        fn, info = inductor.compile_graph(gm, entry, tmp_path, patches)
        assert fn is not None, info
        return info["status"]

    assert status({}) == "compiled"
    assert status({}) == "loaded"
    assert status({"epilogue_fusion": False}) == "compiled"  # other settings: its own artifact
    assert status({"epilogue_fusion": False}) == "loaded" and status({}) == "loaded"
    monkeypatch.setattr(torch, "__version__", "0.0.0-another")
    assert status({}) == "compiled"
    assert len(list(entry.path.glob("inductor-*.bin"))) == 3


@pytest.mark.slow
@needs_standalone_compile
def test_retrace_runs_the_compiled_graph_without_recompiling_and_still_detects_a_change(tmp_path):
    before = inductor.compilations
    _, summary = run_on("csx", tmp_path, "loop.max_steps=4", "backend.retrace_every_iteration=true",
                        "backend.graph_compiler=inductor", "data.val=null", name="re")
    assert summary["traces"] == 4 and summary["executions"] == 4 and summary["graph_compiler"] == "compiled"
    assert inductor.compilations == before + 1  # four traces, one compile

    Changing.calls = 0
    cfg = fixtures.compose("device=csx", f"backend.compile_dir={tmp_path}/c", "backend.retrace_every_iteration=true",
                           "backend.graph_compiler=inductor", "loop.max_steps=5",
                           "model._target_=test_csx_backend.Changing", "data.val=null")
    run = csf.Run(cfg, output_dir=tmp_path / "changing")
    with pytest.raises(csf.CompileError) as info:
        run.fit()
    assert "iteration 3" in str(info.value) and f"test_csx_backend.py:{line_of('CHANGES')}" in str(info.value)
    assert run.global_step == 2 and run.backend.train_step.executions == 2


@needs_standalone_compile
def test_without_inductor_the_interpreted_graph_runs_with_a_one_line_warning(tmp_path, monkeypatch, capsys, caplog):
    import torch._inductor

    def unavailable(*args, **kwargs):
        raise RuntimeError("Failed to find a C++ compiler.\nPlease install one.")

    monkeypatch.setattr(torch._inductor, "standalone_compile", unavailable)
    plain, _ = run_on("csx", tmp_path, *COMMON, "backend.graph_compiler=none", name="plain")
    run, summary = run_on("csx", tmp_path, *COMMON, "backend.graph_compiler=inductor", name="fallback")
    assert summary["status"] == "completed" and summary["graph_compiler"] == "fallback"
    assert max_diff(params_of(plain), params_of(run)) == 0  # the interpreted graph ran
    report = json.loads((tmp_path / "fallback" / "compile_report.json").read_text())
    assert report["graph_compiler"]["reason"] == "RuntimeError: Failed to find a C++ compiler. Please install one."
    events = [json.loads(line) for line in (tmp_path / "fallback" / "events.jsonl").read_text().splitlines()]
    notices = [e for e in events if e["event"] == "csx_graph_compiler_fallback"]
    assert len(notices) == 1 and "C++ compiler" in notices[0]["reason"]
    console = [line for line in (capsys.readouterr().err + caplog.text).splitlines()
               if "csx_graph_compiler_fallback" in line]
    assert console and all("C++ compiler" in line for line in console)


@needs_standalone_compile
def test_the_low_level_api_warns_once_when_it_falls_back(tmp_path, monkeypatch):
    import torch._inductor

    def unavailable(*args, **kwargs):
        raise RuntimeError("Failed to find a C++ compiler")

    monkeypatch.setattr(torch._inductor, "standalone_compile", unavailable)
    lowlevel._reset()
    backend = csf.backend("CSX", compile_dir=str(tmp_path / "c"), graph_compiler="inductor")
    model = csf.compile(fixtures.mlp(), backend)
    optimizer = torch.optim.SGD(model.model.parameters(), lr=0.1)

    @csf.trace
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with pytest.warns(RuntimeWarning, match="graph_compiler=inductor is not available") as record:
        for _ in range(3):
            step(x, y)
    assert len([w for w in record if "graph_compiler" in str(w.message)]) == 1
    lowlevel._reset()


def test_on_a_torch_without_standalone_compile_the_interpreted_graph_runs_naming_the_version(tmp_path, monkeypatch):
    """The Cerebras stack pins torch 2.4, whose Inductor has no standalone_compile: the default
    graph_compiler=inductor falls back with one line naming the feature and the torch it needs (on a newer
    torch the version check is made to see 2.4)."""
    monkeypatch.setattr(compat, "TORCH", (2, 4))
    plain, _ = run_on("csx", tmp_path, "loop.max_steps=3", "backend.graph_compiler=none", name="plain")
    run, summary = run_on("csx", tmp_path, "loop.max_steps=3", "backend.graph_compiler=inductor", name="old")
    assert summary["status"] == "completed" and summary["graph_compiler"] == "fallback"
    assert max_diff(params_of(plain), params_of(run)) == 0  # the interpreted graph ran
    reason = ("backend.graph_compiler=inductor (torch._inductor.standalone_compile) needs torch>=2.8, and this is "
              f"torch {torch.__version__}; upgrade torch, or do without it")
    assert json.loads((tmp_path / "old" / "compile_report.json").read_text())["graph_compiler"]["reason"] == reason
    events = [json.loads(line) for line in (tmp_path / "old" / "events.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in events if e["event"] == "csx_graph_compiler_fallback"] == [reason]


def test_graph_compiler_must_be_inductor_or_none(tmp_path):
    with pytest.raises(csf.ValidationError, match="backend.graph_compiler: 'tvm' is not one of inductor, none"):
        run_on("csx", tmp_path, "backend.graph_compiler=tvm")
    with pytest.raises(csf.ConfigError, match="graph_compiler: 'tvm' is not one of inductor, none; use"):
        csf.backend("CSX", graph_compiler="tvm")


@pytest.mark.parametrize("value", ["tvm", "x${oc.env:HOME}", "${oc.env:CSF_NO_SUCH_VARIABLE}", "\\${x}"])
def test_a_bad_graph_compiler_from_the_environment_names_the_variable(tmp_path, monkeypatch, value):
    """The variable's value is data: before (issue 37) ``x${oc.env:HOME}`` was resolved to the home path, and an
    interpolation that failed to resolve did not name the variable."""
    monkeypatch.setenv("CSF_CSX_GRAPH_COMPILER", value)  # the default's source: the command line never shows it
    from_env = re.escape(f"{value!r} is not one of inductor, none (from the environment variable CSF_CSX_GRAPH_COMPILER")
    with pytest.raises(csf.ValidationError, match="backend.graph_compiler: " + from_env):
        run_on("csx", tmp_path)
    with pytest.raises(csf.ConfigError, match="graph_compiler: " + from_env):
        csf.backend("CSX")


@pytest.mark.slow
def test_inductor_keeps_cbfloat16_rounding_exact():
    """The CB16 emulation is integer bit arithmetic: compiled, it must give the same bits as eager on normal,
    subnormal, tie, overflowing and special values."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4096) * torch.exp2(torch.randint(-40, 40, (4096,)).float()),
                   torch.randn(512) * 2.0 ** -70,  # CB16 subnormals
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38,
                                 1.0 + 2.0 ** -10, 1.0 + 3 * 2.0 ** -10, 2.0 ** -62, 2.0 ** -70])])
    compiled = torch.compile(round_to_cbfloat16, backend="inductor", fullgraph=True)
    eager = round_to_cbfloat16(x)
    assert torch.equal(compiled(x).view(torch.int32), eager.view(torch.int32))
