"""The README's quick start stays true: CI runs exactly its test command, and the commands it shows exist."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.startswith("python3 -m venv")]
    assert len(ci_lines) == 1
    readme = (ROOT / "README.md").read_text()
    assert ci_lines[0] in readme.splitlines(), "README's test command and .ci/run differ"


def test_readme_main_command_trains_the_default():
    readme = (ROOT / "README.md").read_text()
    setup_and_run = [l for l in readme.splitlines() if l.startswith("python3 -m venv") and "pytest" not in l]
    assert setup_and_run and setup_and_run[0].endswith("python -m csframework")
