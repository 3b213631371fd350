"""Shared fixtures. The helpers live in ``tests/support`` (on ``sys.path`` through pytest's ``pythonpath``
setting in pyproject.toml; subprocesses get it through ``fixtures.pythonpath``)."""
import os

import pytest

import fixtures
from csframework.testing import CsfRunner

# The core suite runs without installed third-party plugins (the plugins/ packages test themselves); a test
# of entry points names the ones it wants.
os.environ["CSFRAMEWORK_PLUGINS_AUTOLOAD"] = "0"
# CSX runs interpret their graphs unless a test asks for Inductor (test_csx_inductor.py): a cold Inductor
# compile costs seconds to a minute per graph, and every test has its own compile directory.
os.environ.setdefault("CSF_CSX_GRAPH_COMPILER", "none")


@pytest.fixture(autouse=True)
def _curves_only_where_tested(request, monkeypatch):
    """A run made in the test's own process draws no loss curves at its end (``write_curves``: a third of a
    short run's time, matplotlib rendering a PNG) unless the test is marked ``curves``: the tests of the
    curves themselves. Runs of the command line, in processes of their own, draw them as a user's do."""
    if request.node.get_closest_marker("curves") is None:
        from csframework.builtin import metrics

        monkeypatch.setattr(metrics, "write_curves", lambda *args, **kwargs: None)


def _cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = fixtures.pythonpath()
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@pytest.fixture
def cli_env():
    """Environment for ``python -m csframework`` subprocesses that use the test fixtures."""
    return _cli_env()


@pytest.fixture(scope="module")
def cli_env_module():
    """``cli_env`` for module-scoped fixtures (runs shared by a module's tests)."""
    return _cli_env()


def pytest_collection_modifyitems(items):
    """``@pytest.mark.requires_torch((2, 6), "FSDP2")``: a test of a feature an older torch lacks (the core
    supports torch 2.4, the Cerebras stack's) skips there, naming the version it needs."""
    import torch

    from csframework.compat import TORCH

    for item in items:
        marker = item.get_closest_marker("requires_torch")
        if marker is not None and TORCH < tuple(marker.args[0]):
            version = ".".join(map(str, marker.args[0]))
            what = marker.args[1] if len(marker.args) > 1 else "this test"
            item.add_marker(pytest.mark.skip(reason=f"{what} needs torch>={version}; this is torch {torch.__version__}"))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice; a hook of xdist's only
def pytest_xdist_make_scheduler(config, log):
    """``--dist load``: test by test, but a file whose tests share a module-scoped run stays on one worker
    (``shared_runs.py``)."""
    if config.getvalue("dist") != "load":
        return None
    from shared_runs import SharedRunsScheduling

    return SharedRunsScheduling(config, log)


@pytest.fixture
def runner(tmp_path):
    """``csframework.testing.CsfRunner`` in ``tmp_path``: in-process runs and CLI runs of the tiny config."""
    return CsfRunner(tmp_path)
