import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))


@pytest.fixture
def cli_env():
    """Environment for ``python -m csframework`` subprocesses that use the test fixtures."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.pop("HYDRA_FULL_ERROR", None)
    return env
