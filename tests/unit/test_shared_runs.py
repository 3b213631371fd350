"""How the suite is spread over pytest-xdist's workers (tests/support/shared_runs.py, ``--dist load``): a file
that defines a fixture its tests share is one unit, any other file is spread test by test."""
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="pytest-xdist is in the dev extra: pip install -e '.[dev]'")

from shared_runs import SharedRunsScheduling, defines_a_shared_fixture  # noqa: E402 (needs xdist)

ROOT = Path(__file__).resolve().parents[2]


def scheduling(root: Path) -> SharedRunsScheduling:
    made = SharedRunsScheduling.__new__(SharedRunsScheduling)  # the scope rule alone, without workers
    made.root = root
    return made


def test_a_file_with_a_module_or_class_scoped_fixture_is_one_unit_and_any_other_is_split(tmp_path):
    (tmp_path / "test_module.py").write_text(
        'import pytest\n\n@pytest.fixture(scope="module")\ndef run():\n    return 1\n\ndef test_a(run):\n    pass\n')
    (tmp_path / "test_class.py").write_text(
        "from pytest import fixture\n\nclass TestX:\n    @fixture(scope='class')\n    def made(self):\n        return 1\n")
    (tmp_path / "test_alone.py").write_text(  # a session fixture is made once per worker anyway
        "import pytest\n\n@pytest.fixture\ndef each():\n    return 1\n\n@pytest.fixture(scope='session')\n"
        "def once():\n    return 1\n")
    scopes = scheduling(tmp_path)
    assert scopes._split_scope("test_module.py::test_a[1]") == "test_module.py"
    assert scopes._split_scope("test_class.py::TestX::test_y") == "test_class.py"
    assert scopes._split_scope("test_alone.py::test_b[2]") == "test_alone.py::test_b[2]"


def test_the_suites_shared_runs_stay_together():
    assert defines_a_shared_fixture(ROOT / "tests/e2e/test_hostile_cache.py")  # its filled caches
    assert defines_a_shared_fixture(ROOT / "tests/unit/test_compiled.py")
    assert not defines_a_shared_fixture(ROOT / "tests/e2e/test_doc_recipes.py")  # its blocks spread
