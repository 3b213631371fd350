"""The package works as an installed wheel (issue 2): built from a copy of the checkout, installed
(non-editable) into a fresh virtual environment that cannot see this checkout or its editable install, then
run from an unrelated directory with the embedded default config."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# .venv*: the dev venv and .venv-cerebras (several GB, which .ci/run builds while this runs)
IGNORE = shutil.ignore_patterns(".venv*", ".git", "*.egg-info", "build", "dist", "outputs", "multirun",
                                "__pycache__", ".pytest_cache", "checkpoints", ".csx_cache")


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "HYDRA_"))}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run(cmd, **kwargs):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=clean_env(), **kwargs)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def test_wheel_installs_and_trains_from_anywhere(tmp_path):
    before = {name: (ROOT / name).exists() for name in ("build", "dist")}
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    run([sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", src], timeout=300)
    wheels = list((tmp_path / "dist").glob("csframework-*.whl"))
    assert len(wheels) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "csframework/conf/config.yaml" in names and "csframework/conf/optimizer/adamw.yaml" in names
    assert not any(n.startswith("tests/") for n in names)
    # PEP 561: without the marker, plugin authors' type checkers ignore csframework's annotations
    assert "csframework/py.typed" in names
    assert "csframework/builtin/checkpoint/plugin.py" in names  # every subpackage is listed in pyproject

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], timeout=120)
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "torch==2.13.0", wheels[0]], timeout=600)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([python, "-c", "import csframework; print(csframework.__file__)"], cwd=elsewhere).stdout
    assert str(venv) in where and str(ROOT) not in where  # the installed copy, not the checkout

    run_dir = tmp_path / "run"
    run([python, "-m", "csframework", "loop.max_steps=20", "loop.eval_steps=2", "loop.log_every=10",
         f"hydra.run.dir={run_dir}"], cwd=elsewhere, timeout=300)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 20
    assert summary["metrics"]["val/loss"] > 0 and (run_dir / "checkpoints").is_dir()

    check_dir = tmp_path / "check"
    r = run([venv / "bin" / "csframework", "mode=check", f"hydra.run.dir={check_dir}"], cwd=elsewhere, timeout=120)
    assert "check passed: device CPU" in r.stdout
    assert not (check_dir / "checkpoints").exists()

    assert list(elsewhere.iterdir()) == []  # nothing was written into the working directory
    assert {name: (ROOT / name).exists() for name in before} == before  # the build left the checkout alone
