"""benchmarks/data_fetch.py keeps working: one short round prints its three figures (the figures themselves
are in the report, never asserted)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_data_fetch_benchmark_prints_its_figures():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "benchmarks.data_fetch", "--rounds", "1", "--steps", "30"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split("|")[1].split("(")[0].strip() for row in rows] == [
        "steps, batched fast path vs pre-made batches", "steps, per-sample path vs pre-made batches",
        "loader read, batched vs per-sample"]
    assert all(row.split("|")[4].strip().endswith("x") for row in rows)  # a ratio against its baseline
