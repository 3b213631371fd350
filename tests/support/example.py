"""The ``examples/classify`` project and its README's commands, run as a user runs them: shared by
tests/e2e/test_example.py and test_collect_example.py."""
import os
import subprocess
import sys
from pathlib import Path


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "classify"
README = (EXAMPLE / "README.md").read_text()


def example_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    env["OMP_NUM_THREADS"] = "1"  # a small MLP: one thread is fastest, and robust on a busy machine
    return env


def shell(command: str, run_dir: Path | None = None, extra: str = ""):
    """A README command (plus ``extra``), with ``python`` this interpreter and the run directory moved to
    ``run_dir``."""
    assert command in README, f"the README no longer shows: {command}"
    if run_dir is not None:
        command = command.replace("outputs/spirals", str(run_dir))
    command = command.replace("python ", f"{sys.executable} ", 1) + extra
    r = subprocess.run(command, shell=True, cwd=EXAMPLE, env=example_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return r
