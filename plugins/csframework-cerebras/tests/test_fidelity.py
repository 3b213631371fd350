"""The emulator (device=csx) against the real cstorch: the parameters the same model reaches, which steps run
the step's Python, and which data-dependent Python or operation is refused (docs/guides/csx.md, "Against the real
cstorch"). A cluster cannot be reached here, so the real tracer is cstorch's lazy device under compile_only
(one step, traced and lowered locally); cstorch's CPU backend runs the step eagerly."""
import json

import pytest
import torch

pytest.importorskip("cerebras.pytorch", reason="cerebras-pytorch is not installed (it has its own venv: see README)")

from bridge_runs import BRIDGE, EMULATOR, HERE, cli  # noqa: E402

pytestmark = pytest.mark.slow
REAL_TRACER = ["backend=cerebras", "backend.compile_only=true"]
SHORT = ["loop.max_steps=6", "loop.eval_every=6"]
OLD_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5)


def params(run_dir):
    newest = json.loads((run_dir / "checkpoints" / "index.json").read_text())["checkpoints"][-1]
    return torch.load(run_dir / "checkpoints" / newest / "state.pt", weights_only=True)["model"]


def line_of(text: str) -> int:
    source = (HERE / "fidelity_nets.py").read_text().splitlines()
    return next(i for i, code in enumerate(source, 1) if text in code)


@pytest.mark.parametrize("name", ["bridge", "csx"])
def test_the_emulator_and_the_cstorch_cpu_backend_reach_the_parameters_of_device_cpu(runs, name):
    """12 SGD steps (momentum, warm-up and cosine schedule) on each: parameters within 1e-5."""
    cpu, theirs = params(runs["cpu"].output_dir), params(runs[name].output_dir)
    assert theirs.keys() == cpu.keys()
    for key in cpu:
        assert torch.allclose(theirs[key], cpu[key], atol=1e-5, rtol=0), (name, key)


def test_which_steps_run_the_python_of_the_step(runs, csf_runner):
    """The emulator traces the step once (every step with retrace_every_iteration); cstorch's lazy tracer
    traces the first step of an executor (all compile_only runs); cstorch's CPU backend runs the Python of
    every step (it does not trace)."""
    assert runs["csx"].summary["traces"] == 1
    assert runs["bridge"].summary["traces"] == 12
    retraced = cli(csf_runner, [*EMULATOR, *SHORT, "backend.retrace_every_iteration=true"])
    assert retraced.exit_code == 0, retraced.stderr[-1500:]
    assert retraced.summary["traces"] == 6
    for retrace in ("false", "true"):
        real = cli(csf_runner, [*REAL_TRACER, *SHORT, f"backend.retrace_every_iteration={retrace}"])
        assert real.exit_code == 2, real.stderr[-1500:]  # ends at the missing cluster, after one step
        assert real.summary["traces"] == 1


REFUSED = [("ItemNet", "y.sum().item()"), ("BoolNet", "if y.mean() > -1e9"), ("TolistNet", ".tolist()"),
           ("CpuNet", "y.cpu()"), ("MaskNet", "y[y > 0]"), ("NonzeroNet", "torch.nonzero(y > 0)")]


def assert_refused_naming_the_line(result, net, code):
    last = result.stderr.strip().splitlines()[-1]
    assert result.exit_code == 1, (net, result.stderr[-1500:])
    assert f"fidelity_nets.py:{line_of(code)}" in last, (net, last)
    assert "frame #" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("net, code", REFUSED)
def test_the_real_tracer_refuses_data_dependent_python_naming_the_line(csf_runner, net, code):
    """``torch.nonzero`` is traced by cstorch's lazy tracer, and refused by its lowering to Cerebras IR,
    which cstorch only writes to a file (``traceback_*.json``): the bridge raises it."""
    assert_refused_naming_the_line(cli(csf_runner, [*REAL_TRACER, *SHORT, f"model.net._target_=fidelity_nets.{net}"]),
                                   net, code)


@pytest.mark.parametrize("net, code", [
    pytest.param(net, code, marks=pytest.mark.xfail(
        OLD_TORCH and net == "TolistNet", strict=False,
        reason="on torch 2.4 the emulator's .tolist() check ends in PendingUnbackedSymbolNotFound (a traceback)"))
    for net, code in REFUSED])
def test_the_emulator_refuses_the_same_naming_the_line(csf_runner, net, code):
    assert_refused_naming_the_line(cli(csf_runner, [*EMULATOR, *SHORT, f"model.net._target_=fidelity_nets.{net}"]),
                                   net, code)


def test_cstorch_cpu_runs_data_dependent_python_eagerly(csf_runner):
    assert cli(csf_runner, [*BRIDGE, *SHORT, "model.net._target_=fidelity_nets.ItemNet"]).exit_code == 0


def test_an_operation_cstorch_cannot_trace_is_refused_by_it_alone(csf_runner):
    """``torch.linalg.det``: the emulator, which knows no list of Cerebras operations, trains it; cstorch's lazy
    tracer has no shape function for its backward (``aten::diag_embed``) and refuses it, naming the step's
    backward line (no user code is on the stack of a backward pass)."""
    emulated = cli(csf_runner, [*EMULATOR, *SHORT, "model.net._target_=fidelity_nets.DetNet"])
    assert emulated.exit_code == 0, emulated.stderr[-1500:]
    real = cli(csf_runner, [*REAL_TRACER, *SHORT, "model.net._target_=fidelity_nets.DetNet"])
    last = real.stderr.strip().splitlines()[-1]
    assert real.exit_code == 1 and "Traceback" not in real.stderr, real.stderr[-1500:]
    assert "step.py" in last and "ops.backward(" in last and "aten::diag_embed" in last
