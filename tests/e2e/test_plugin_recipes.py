"""The plugin-author recipes of docs/guides/writing-plugins.md and docs/guides/plugins.md work as written: their
files are taken from the documents, pip-installed (a real install, with the entry point) and their tests run with
pytest in a fresh directory outside this project, where only the installed csframework provides ``csf_runner``
and ``csf_hook_recorder``. CI runs the plugins/ packages the same way after the core suite."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import files_of
from fixtures import pip_install_target

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("document, package, entry_point, files", [
    ("docs/guides/writing-plugins.md", "csframework-target", "target",
     {"pyproject.toml", "src/csf_target/__init__.py", "tests/test_target.py"}),
    ("docs/guides/plugins.md", "csframework-best-metric", "best_metric",
     {"pyproject.toml", "README.md", "src/csf_best_metric/__init__.py", "tests/test_best_metric.py"}),
])
def test_a_documented_plugin_package_installs_and_its_tests_pass(tmp_path, document, package, entry_point, files):
    found = files_of(ROOT / document, package)
    assert set(found) == files
    project = tmp_path / package
    for path, text in found.items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(text)
    site = tmp_path / "site"
    pip_install_target(project, site)
    env = dict(os.environ, PYTHONPATH=str(site), CSFRAMEWORK_PLUGINS_AUTOLOAD=entry_point)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{package}/tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    count = len(re.findall(r"^def test_", found[next(p for p in files if p.startswith("tests/"))], re.M))
    assert f"{count} passed" in done.stdout


def test_ci_installs_and_tests_the_plugin_packages_as_the_readme_says():
    ci = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.startswith("python3 -m venv")]
    step = "pip install -q ./plugins/csframework-* && python -m pytest -q -n auto --dist loadfile plugins"
    assert len(ci) == 1 and ci[0].endswith(step) and ci[0] in (ROOT / "README.md").read_text().splitlines()
    packages = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())
    assert packages == ["csframework-cerebras", "csframework-early-stopping", "csframework-mlflow",
                        "csframework-tensorboard"]
    for name in packages:
        assert f"plugins/{name}" in (ROOT / "README.md").read_text()
        assert list((ROOT / "plugins" / name / "tests").glob("test_*.py"))
