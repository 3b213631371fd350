"""The library type-checks (issue 28 item 6): plugin authors get csframework's types through py.typed, so
mypy, configured in pyproject.toml ([tool.mypy]: strict for hookspecs, api, testing and config/), must pass
over csframework/. CI runs this with the dev extra, which installs mypy."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mypy_passes_over_the_library():
    # the files and flags come from pyproject.toml; the cache (.mypy_cache, gitignored) keeps reruns fast
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_py_typed_marker_ships_with_the_package():
    import csframework

    assert (Path(csframework.__file__).parent / "py.typed").is_file()
