"""How the suite is spread over pytest-xdist's workers (tests/support/shared_runs.py, ``--dist load``): the
tests of a file that share a fixture it makes once are one unit, any other test is a unit of its own."""
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="pytest-xdist is in the dev extra: pip install -e '.[dev]'")

from shared_runs import SharedRunsScheduling  # noqa: E402 (needs xdist)

ROOT = Path(__file__).resolve().parents[2]
SHARED = '''
import pytest
from pytest import fixture


@pytest.fixture(scope="module")
def run():
    return 1


@fixture
def copied(run, tmp_path):
    return run


@pytest.fixture(scope="session")
def once():
    return 1


def test_direct(run):
    pass


@pytest.mark.parametrize("i", [1, 2])
def test_through_a_fixture(copied, i):
    pass


def test_alone(once, tmp_path):
    pass
'''


def scheduling(root: Path) -> SharedRunsScheduling:
    made = SharedRunsScheduling.__new__(SharedRunsScheduling)  # the scope rule alone, without workers
    made.root = root
    return made


def test_the_tests_sharing_a_module_scoped_fixture_are_one_unit_and_the_others_are_split(tmp_path):
    (tmp_path / "test_shared.py").write_text(SHARED)
    (tmp_path / "test_class.py").write_text(  # a class's fixture: the file stays whole
        "from pytest import fixture\n\nclass TestX:\n    @fixture(scope='class')\n    def made(self):\n"
        "        return 1\n\n    def test_y(self, made):\n        pass\n")
    scopes = scheduling(tmp_path)
    assert scopes._split_scope("test_shared.py::test_direct") == "test_shared.py"
    assert scopes._split_scope("test_shared.py::test_through_a_fixture[2]") == "test_shared.py"
    assert scopes._split_scope("test_shared.py::test_alone") == "test_shared.py::test_alone"  # session: per worker
    assert scopes._split_scope("test_class.py::TestX::test_y") == "test_class.py"
    # a helper class (no Test* name: pytest collects no test from it) does not keep the file whole
    (tmp_path / "test_helper.py").write_text("class Block:\n    pass\n\n\n" + SHARED)
    assert scopes._split_scope("test_helper.py::test_direct") == "test_helper.py"
    assert scopes._split_scope("test_helper.py::test_alone") == "test_helper.py::test_alone"


def test_the_suites_shared_runs_stay_together_and_the_rest_spreads():
    scopes = scheduling(ROOT)
    cache = "tests/e2e/test_hostile_cache.py"
    assert scopes._split_scope(f"{cache}::test_a_planted_module_in_a_shared_cache_never_runs[csx]") == cache
    lone = f"{cache}::test_float32_and_cbfloat16_compiled_into_one_cache_each_keep_their_own_losses"
    assert scopes._split_scope(lone) == lone  # makes its own caches
    recipe = "tests/e2e/test_doc_recipes.py::test_every_block_is_run_or_listed"
    assert scopes._split_scope(recipe) == recipe
