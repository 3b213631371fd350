"""Shared fixtures. The helpers live in ``tests/support`` (on ``sys.path`` through pytest's ``pythonpath``
setting in pyproject.toml; subprocesses get it through ``fixtures.pythonpath``)."""
import os

import pytest

import fixtures


@pytest.fixture
def cli_env():
    """Environment for ``python -m csframework`` subprocesses that use the test fixtures."""
    env = dict(os.environ)
    env["PYTHONPATH"] = fixtures.pythonpath()
    env.pop("HYDRA_FULL_ERROR", None)
    return env
