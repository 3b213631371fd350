"""A sweep as a user runs it, then reruns it (issue 39 items 2 and 6): it ends with one line counting its
jobs, naming the best one with its overrides and where the table and the plot are; rerun with
``checkpoint.resume=auto`` its finished jobs are skipped (and counted so); rerun without it, each job's
directory holds a run, so each job is refused naming it and how to continue the sweep (a fresh run never
starts over a run), its run and row left as they were."""
from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import CONF, TINY

ARGV = ["-m", "--config-dir", CONF, *[o for o in TINY if not o.startswith(("optimizer", "loop.max_steps"))],
        "loop.max_steps=3", "optimizer=sgd,adamw", "optimizer.lr=0.05"]


def multirun(sweep_dir: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "csframework", *ARGV, *extra, f"hydra.sweep.dir={sweep_dir}"],
                          env=env, capture_output=True, text=True, timeout=600)


def ended(stderr: str) -> str:
    [line] = [line for line in stderr.splitlines() if line.startswith("csframework: sweep ended:")]
    return line


@pytest.mark.slow
def test_a_sweep_reports_its_end_and_a_rerun_skips_or_refuses_its_jobs(tmp_path, cli_env):
    d = tmp_path / "sweep"
    first = multirun(d, cli_env)
    assert first.returncode == 0, first.stderr[-3000:]
    with open(d / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    best = min(rows, key=lambda r: float(r["val/loss"]))
    plot = d / "sweep.png" if (d / "sweep.png").exists() else d / "sweep.svg"
    assert ended(first.stderr) == (
        f"csframework: sweep ended: 2 jobs (2 completed, 0 failed, 0 skipped); best job {best['job']} "
        f"(optimizer={best['optimizer']}): val/loss={float(best['val/loss']):.6g}; table: {d / 'sweep.csv'}, "
        f"plot: {plot}")
    resumed = multirun(d, cli_env, "checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.match(r"csframework: sweep ended: 2 jobs \(0 completed, 0 failed, 2 skipped\); best job "
                    f"{best['job']} ", ended(resumed.stderr)), resumed.stderr[-3000:]
    again = multirun(d, cli_env)
    assert again.returncode == 1, again.stderr[-3000:]
    for job in (0, 1):  # each refused naming its directory and the command that continues the sweep
        assert re.search(rf"job {job} \(.*\) failed: run directory {re.escape(str(d / str(job)))} holds a run "
                         r"\(checkpoints, summary.json, metrics.csv, events.jsonl\); continue it with: \S+ -m .* "
                         rf"checkpoint.resume=auto hydra.sweep.dir={re.escape(str(d))}, or start", again.stderr)
    # the runs in the job directories, and their rows, are left as they were
    assert re.match(r"csframework: sweep ended: 2 jobs \(0 completed, 0 failed, 0 skipped, 2 refused\); best job "
                    f"{best['job']} ", ended(again.stderr)), again.stderr[-3000:]
    with open(d / "sweep.csv", newline="") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["completed", "completed"]
