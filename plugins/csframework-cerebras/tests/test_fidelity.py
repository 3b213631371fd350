"""The emulator (device=csx) against the real cstorch: which steps run their Python once, and which
data-dependent Python is refused (docs/csx.md, "The emulator and the real stack"). A cluster cannot be
reached here, so the real tracer is cstorch's lazy device under compile_only (one step, lowered locally)."""
import os
from pathlib import Path

import pytest

pytest.importorskip("cerebras.pytorch", reason="cerebras-pytorch is not installed (it has its own venv: see README)")

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
       "CSF_CSX_GRAPH_COMPILER": "none"}
EMULATOR = ["device=csx", "backend.graph_compiler=none"]
REAL_TRACER = ["backend=cerebras", "backend.compile_only=true"]
CPU_BRIDGE = ["backend=cerebras", "backend.type=CPU"]


def cli(csf_runner, overrides):
    return csf_runner.cli([*overrides, "loop.max_steps=6", "loop.eval_every=6"], autoload=["cerebras"], env=ENV)


def test_the_step_runs_its_python_once_on_the_emulator_every_step_on_cstorch_cpu(csf_runner):
    emulated, bridged = cli(csf_runner, EMULATOR), cli(csf_runner, CPU_BRIDGE)
    assert emulated.exit_code == 0 and bridged.exit_code == 0, (emulated.stderr[-800:], bridged.stderr[-800:])
    assert emulated.summary["traces"] == 1
    assert bridged.summary["traces"] == 6  # cstorch's CPU backend does not trace: documented in docs/csx.md


@pytest.mark.parametrize("net, line", [("ItemNet", "y.sum().item()"), ("BoolNet", "if y.mean() > -1e9")])
def test_data_dependent_python_is_refused_by_both_tracers_naming_the_line(csf_runner, net, line):
    target = f"model.net._target_=fidelity_nets.{net}"
    source = (HERE / "fidelity_nets.py").read_text().splitlines()
    lineno = next(i for i, text in enumerate(source, 1) if line in text)
    for tracer in (EMULATOR, REAL_TRACER):
        result = cli(csf_runner, [*tracer, target])
        last = result.stderr.strip().splitlines()[-1]
        assert result.exit_code == 1, (tracer, result.stderr[-1500:])
        assert f"fidelity_nets.py:{lineno}" in last, (tracer, last)
        assert "frame #" not in result.stderr and "Traceback" not in result.stderr
    # cstorch's CPU backend runs the step eagerly: the same Python reads real values and trains
    assert cli(csf_runner, [*CPU_BRIDGE, target]).exit_code == 0
