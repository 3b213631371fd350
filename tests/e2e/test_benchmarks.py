"""benchmarks/loop_overhead.py keeps working (a short run; the figures themselves are in the report)."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "loop_overhead.py"


def test_loop_overhead_benchmark_runs(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--steps", "30", "--rounds", "2", "--log-every", "10"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split()[0] + " " + line.split()[1]: line.split() for line in r.stdout.splitlines()
            if line.startswith("  hand-written") or line.startswith("  csframework")}
    assert set(rows) == {"hand-written loop", "csframework fit()", "csframework steps"}
    assert 0.5 < float(rows["csframework fit()"][3]) < 3  # a ratio framework / hand-written
    assert "overhead" in r.stdout and list(tmp_path.iterdir()) == []  # the runs wrote into a temporary dir


@pytest.mark.parametrize("side", ["csframework", "hand", "hydra"])
def test_startup_contestants_report_their_first_step(side):
    """benchmarks/startup.py: each contestant's child reaches its first step (the FirstStep plugin inside
    ``python -m csframework``, the stamp of the hand-written script) and the times are in order."""
    from benchmarks import harness

    result = harness.run_once(harness.python("benchmarks.startup", "--contestant", f"{side}-mlp"), timeout=300)
    assert 0 < result["first_step_cpu_s"] and 0 < result["first_step_s"] <= result["run_s"]
