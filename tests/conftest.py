import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
# The core suite runs without installed third-party plugins (plugins/ packages test themselves); a test
# of entry points names the ones it wants.
os.environ["CSFRAMEWORK_PLUGINS_AUTOLOAD"] = "0"


@pytest.fixture
def cli_env():
    """Environment for ``python -m csframework`` subprocesses that use the test fixtures."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.pop("HYDRA_FULL_ERROR", None)
    return env
