"""The headline command, ``python -m csframework device=csx backend.retrace_every_iteration=true``, against the
same command on ``device=cpu`` (issue 48): whole commands, wall time, fresh processes, one torch thread.

    python -m benchmarks.csx_headline [--rounds N] [--steps S]     # the figures (interleaved fresh processes)
    python -m benchmarks.csx_headline --contestant csx-retrace     # one measurement (a JSON line)

Each contestant is a fresh process that runs the command (``loop.max_steps=S``, a fresh run directory and, on
CSX, an empty ``backend.compile_dir``: a new user's cold start) as its child, times it from start to exit and
reads its ``summary.json`` and ``compile_report.json``. ``$CSF_CSX_GRAPH_COMPILER`` is removed from the
children's environment, so the figures are those of the default ``backend.graph_compiler``
(``--graph-compiler`` sets one). The figures:

- the headline command's wall time / ``device=cpu``'s (target <= 1.5x);
- ``device=csx`` (no retracing) / ``device=cpu`` (<= 1.2x);
- the cold start of ``device=csx``: the seconds before the first step executes (the trace, and the graph's
  analysis and compile), from its compile report (<= 10 s);
- what retracing adds to a step (the headline run's seconds of training, tracing and compiling per step, less
  the ``device=csx`` run's) / one eager step (the ``device=cpu`` run's training seconds per step) (<= 0.25x);
- the test fixtures' small MLP (``model=blobs_mlp data=blobs``) on ``device=csx`` / ``device=cpu`` (<= 1.5x).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import harness

MODULE = "benchmarks.csx_headline"
ROOT = Path(__file__).resolve().parents[1]
MLP = ["--config-dir", str(ROOT / "tests" / "support" / "conf"), "model=blobs_mlp", "data=blobs"]
CONTESTANTS = {
    "cpu": ["device=cpu"],
    "csx": ["device=csx"],
    "csx-retrace": ["device=csx", "backend.retrace_every_iteration=true"],
    "mlp-cpu": [*MLP, "device=cpu"],
    "mlp-csx": [*MLP, "device=csx"],
}


def command(name: str, steps: int, workdir: str, graph_compiler: str | None) -> list[str]:
    """The ``python -m csframework`` command of contestant ``name`` writing under ``workdir``."""
    overrides = [*CONTESTANTS[name], f"loop.max_steps={steps}", f"hydra.run.dir={workdir}/run"]
    if "device=csx" in overrides:
        overrides.append(f"backend.compile_dir={workdir}/compile")
        if graph_compiler:
            overrides.append(f"backend.graph_compiler={graph_compiler}")
    return [sys.executable, "-m", "csframework", *overrides]


def contestant(name: str, steps: int, graph_compiler: str | None) -> dict:
    """Run contestant ``name``'s command once, cold; its wall time and the seconds its summary reports."""
    env = harness.contestant_env()
    env.pop("CSF_CSX_GRAPH_COMPILER", None)
    workdir = tempfile.mkdtemp(prefix="csf-headline-")
    try:
        start = time.perf_counter()
        done = subprocess.run(command(name, steps, workdir, graph_compiler), cwd=ROOT, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
        run_dir = Path(workdir) / "run"
        summary = json.loads((run_dir / "summary.json").read_text())
        steps_done = summary["global_step"]
        train = summary.get("train_seconds")  # (a csframework before issue 48 gives steps_per_sec only)
        result = {"contestant": name, "wall_s": wall, "steps": steps_done,
                  "train_seconds": train if train is not None else steps_done / summary["steps_per_sec"],
                  "compile_seconds": summary["compile_seconds"]}
        if (run_dir / "compile_report.json").exists():
            report = json.loads((run_dir / "compile_report.json").read_text())
            compiler = report.get("graph_compiler", {})
            # before the first step executes: the first trace, the graph's analysis and its compile (or load)
            result.update(first_trace_s=report["trace_seconds"], graph_compiler=compiler.get("status"),
                          cold_start_s=report["trace_seconds"] + report.get("compile_seconds", 0.0)
                          + compiler.get("seconds", 0.0),
                          traces=summary.get("traces"), trace_seconds=summary.get("trace_seconds"))
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure(rounds: int, steps: int, graph_compiler: str | None = None) -> dict[str, list[dict]]:
    base = harness.python(MODULE, "--steps", str(steps), *(["--graph-compiler", graph_compiler] if graph_compiler
                                                               else []))
    return harness.interleaved({name: [*base, "--contestant", name] for name in CONTESTANTS}, rounds)


def retrace_seconds(retrace: dict, once: dict) -> float:
    """What retracing adds to a step: the headline run's seconds of training, tracing and compiling per step,
    less those of the ``device=csx`` run of the same round (a retrace of an interpreted graph runs as the step
    itself, so its seconds are part of the training seconds)."""
    def per_step(result: dict) -> float:
        return (result["train_seconds"] + result["compile_seconds"]) / result["steps"]
    return per_step(retrace) - per_step(once)


def figures(rounds: int, steps: int = 30, graph_compiler: str | None = None,
            results: dict[str, list[dict]] | None = None) -> list[harness.Figure]:
    results = results or measure(rounds, steps, graph_compiler)
    cmd = f"python -m {MODULE} --rounds {rounds} --steps {steps}"
    wall = {name: [r["wall_s"] for r in rows] for name, rows in results.items()}
    eager_step = [r["train_seconds"] / r["steps"] for r in results["cpu"]]
    return [
        harness.Figure(f"headline: device=csx backend.retrace_every_iteration=true, {steps} steps, wall time", "s",
                       wall["csx-retrace"], baseline="device=cpu", baseline_samples=wall["cpu"], target="<= 1.5x",
                       limit=1.5, command=cmd),
        harness.Figure(f"device=csx, {steps} steps, wall time", "s", wall["csx"], baseline="device=cpu",
                       baseline_samples=wall["cpu"], target="<= 1.2x", limit=1.2, command=cmd),
        harness.Figure("device=csx cold start: trace + compile before the first step (embedded default)", "s",
                       [r["cold_start_s"] for r in results["csx"]], target="<= 10 s", limit=10.0, command=cmd,
                       kind="value"),
        harness.Figure("what a retrace adds to a step vs an eager step (embedded default)", "s",
                       [retrace_seconds(r, c) for r, c in zip(results["csx-retrace"], results["csx"])],
                       baseline="eager step",
                       baseline_samples=eager_step, target="<= 0.25x", limit=0.25, command=cmd),
        harness.Figure(f"small MLP (blobs_mlp), device=csx, {steps} steps, wall time", "s", wall["mlp-csx"],
                       baseline="device=cpu", baseline_samples=wall["mlp-cpu"], target="<= 1.5x", limit=1.5,
                       command=cmd),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of fresh processes")
    parser.add_argument("--steps", type=int, default=30, help="loop.max_steps of every command")
    parser.add_argument("--contestant", choices=list(CONTESTANTS), help="one measurement, printed as JSON")
    parser.add_argument("--graph-compiler", choices=["inductor", "none"], default=None,
                        help="backend.graph_compiler of the csx commands (default: the config's default)")
    args = parser.parse_args(argv)
    if args.contestant:
        print(json.dumps(contestant(args.contestant, args.steps, args.graph_compiler)))
    else:
        print(harness.table(figures(args.rounds, args.steps, args.graph_compiler)))


if __name__ == "__main__":
    main()
