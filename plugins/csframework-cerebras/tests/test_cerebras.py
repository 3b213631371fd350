"""csframework-cerebras against the real cerebras-pytorch (cstorch) of its own venv. Without cstorch (the core's
CI venv, torch 2.13) every test here is skipped.

cstorch keeps one backend per process (and refuses a second of another type), so each run is a fresh
``python -m csframework`` process (``csf_runner.cli``)."""
import json

import pytest
import torch

pytest.importorskip("cerebras.pytorch", reason="cerebras-pytorch is not installed (it has its own venv: see README)")

pytestmark = pytest.mark.slow
ONLY = ["cerebras"]
TINY = ["loop.eval_every=4"]
BRIDGE = ["backend=cerebras", "backend.type=CPU"]


def cli(csf_runner, overrides, **kw):
    return csf_runner.cli(overrides, autoload=ONLY, **kw)


def params(run_dir):
    """The newest checkpoint's model parameters (``checkpoints/index.json`` lists them, oldest first)."""
    newest = json.loads((run_dir / "checkpoints" / "index.json").read_text())["checkpoints"][-1]
    return torch.load(run_dir / "checkpoints" / newest / "state.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 8-step SGD run on device=cpu and through the bridge (cstorch's CPU backend)."""
    from csframework.testing import CsfRunner

    out = {}
    for name, device in (("cpu", ["device=cpu"]), ("bridge", BRIDGE)):
        result = CsfRunner(tmp_path_factory.mktemp(name)).cli([*device, *TINY, "loop.max_steps=8"], autoload=ONLY)
        assert result.exit_code == 0, result.stderr[-2000:]
        out[name] = result
    return out


def test_the_bridge_trains_through_cstorch(runs):
    summary = runs["bridge"].summary
    assert summary["status"] == "completed" and summary["global_step"] == 8
    assert summary["device_type"] == "CSX" and summary["cerebras"]["type"] == "CPU"
    assert summary["traces"] == 8  # cstorch's CPU backend runs the step's Python every step (no trace)
    assert "val/loss" in summary["metrics"]


def test_parameters_match_device_cpu(runs):
    ours, theirs = params(runs["bridge"].output_dir), params(runs["cpu"].output_dir)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.allclose(ours[key], theirs[key], atol=1e-5, rtol=0), key
    assert runs["bridge"].summary["metrics"]["train/loss"] == pytest.approx(
        runs["cpu"].summary["metrics"]["train/loss"], abs=1e-5)


def test_resume_is_exact(csf_runner, runs, tmp_path):
    first = cli(csf_runner, [*BRIDGE, *TINY, "loop.max_steps=5"])
    assert first.exit_code == 0, first.stderr[-2000:]
    resumed = cli(csf_runner, [*BRIDGE, *TINY, "loop.max_steps=8", "checkpoint.resume=auto"],
                  output_dir=first.output_dir)
    assert resumed.exit_code == 0, resumed.stderr[-2000:]
    assert resumed.summary["global_step"] == 8
    ours, theirs = params(resumed.output_dir), params(runs["bridge"].output_dir)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_compile_only_lowers_locally_and_names_the_cluster_setting(csf_runner):
    result = cli(csf_runner, ["backend=cerebras", "backend.compile_only=true", *TINY, "loop.max_steps=8"])
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("csframework: error: cerebras.mgmt_address:") and "Traceback" not in result.stderr
    assert "ClusterConfigError" not in last
    lowered = sorted(p.name for p in (result.output_dir / "cerebras" / "executors" / "000001").glob("*.mlir"))
    assert lowered == ["cirh.mlir", "torch.mlir"]
    assert "torch.vtensor" in (result.output_dir / "cerebras" / "executors" / "000001" / "torch.mlir").read_text()
    assert not (result.output_dir / "checkpoints").exists() or not any((result.output_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("override, key", [
    ("backend.type=GPU", "backend.type"),
    ("cerebras.job_priority=urgent", "cerebras.job_priority"),
    ("cerebras.mgmt_address=nohost", "cerebras.mgmt_address"),
    ("optimizer._target_=torch.optim.RMSprop", "optimizer._target_"),
    ("backend.num_csx=0", "backend.num_csx"),
    ("cerebras.job_time_sec=soon", "cerebras.job_time_sec"),
])
def test_bad_settings_exit_2_naming_the_key(csf_runner, override, key):
    result = cli(csf_runner, ["backend=cerebras", *TINY, override])
    assert result.exit_code == 2, result.stderr[-2000:]
    assert key in result.stderr and "Traceback" not in result.stderr
    assert not result.output_dir.exists() or not (result.output_dir / "summary.json").exists()


def test_training_on_the_cluster_without_an_address_is_refused_before_launch(csf_runner):
    result = cli(csf_runner, ["backend=cerebras", *TINY])
    assert result.exit_code == 2
    assert "cerebras.mgmt_address" in result.stderr.strip().splitlines()[-1]


def test_device_and_the_cerebras_backend_are_exclusive(csf_runner):
    result = cli(csf_runner, ["device=csx", "backend=cerebras", *TINY])
    assert result.exit_code == 2 and "device, backend: both choose the device" in result.stderr
