"""The examples gallery (examples/<name>/) run as a user runs it: a command its README shows, from the
example's directory, with this interpreter, plus the short form a test adds (issue 40 item 3)."""
import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def readme(example: str) -> str:
    return (EXAMPLES / example / "README.md").read_text()


def run(example: str, command: str, extra: str = "", *, env: dict | None = None, timeout: float = 300,
        status: int = 0) -> subprocess.CompletedProcess:
    """``command`` (which the example's README must show, word for word) plus ``extra``, in the example's
    directory; its exit status must be ``status``."""
    assert command in readme(example), f"examples/{example}/README.md no longer shows: {command}"
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    environment.update(OMP_NUM_THREADS="1", **(env or {}))
    line = command.replace("python ", f"{sys.executable} ", 1) + extra
    done = subprocess.run(line, shell=True, cwd=EXAMPLES / example, env=environment, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == status, f"exit {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
