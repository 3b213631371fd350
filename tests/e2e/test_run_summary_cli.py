"""summary.json records the command line of a CLI run as it was typed."""
import json
import subprocess
import sys

import pytest

import fixtures


@pytest.mark.slow
def test_the_command_line_is_recorded_as_typed(tmp_path, cli_env):
    argv = ["--config-dir", fixtures.CONF, *fixtures.TINY, "loop.max_steps=1", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run([sys.executable, "-m", "csframework", *argv], env=cli_env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["command_line"] == " ".join(["python -m csframework", *argv])
