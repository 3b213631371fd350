"""A third-party backend package (tests/support/toy_backend) supplies the device type TOY through the
``csframework_backend`` hook: it trains through the CLI, and its settings are validated like CSX's."""
import json
import subprocess
import sys

import pytest

import fixtures

pytestmark = pytest.mark.slow

TINY = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "loop.eval_steps=2"]


@pytest.fixture
def toy_env(tmp_path, cli_env):
    """The toy package installed as pip would leave it: a dist-info with the entry point."""
    site = tmp_path / "site"
    info = site / "toy_backend-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[csframework.plugins]\ntoy = toy_backend.plugin\n")
    return dict(cli_env, PYTHONPATH=f"{site}:{cli_env['PYTHONPATH']}", CSFRAMEWORK_PLUGINS_AUTOLOAD="toy")


def cli(env, *overrides):
    return subprocess.run([sys.executable, "-m", "csframework", *TINY, *overrides], env=env,
                          capture_output=True, text=True, timeout=180)


def test_a_third_party_backend_trains_through_the_cli(tmp_path, toy_env):
    r = cli(toy_env, "device=toy", "backend.lr_scale=0.5", "loop.max_steps=4", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 4
    assert summary["device_type"] == "TOY" and summary["toy"] is True
    assert "val/loss" in summary["metrics"]


@pytest.mark.parametrize("overrides, line", [
    (["device=toy", "backend.turbo=1"], "backend.turbo: the TOY backend has no such setting"),
    (["device=toy", "backend.lr_scale=abc"], "backend.lr_scale: Value 'abc' of type 'str' could not be converted"),
    (["device=toy", "backend.lr_scale=-1"], "backend.lr_scale: -1.0 must be > 0"),
    (["device=toy", "backend.num_csx=2"], "backend.num_csx: only CSX understands it, and this run's device is TOY"),
    (["device=cpu", "backend.lr_scale=2"], "backend.lr_scale: only TOY understands it, and this run's device is CPU"),
], ids=["unknown-key", "wrong-type", "rule", "csx-key", "toy-key-on-cpu"])
def test_its_settings_are_validated_like_csx(tmp_path, toy_env, overrides, line):
    r = cli(toy_env, *overrides, "loop.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr
    assert line in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
