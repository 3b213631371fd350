"""Start-up: time to the end of the first optimizer step of ``python -m csframework``, against a hand-written
script (``benchmarks/startup_hand.py``) that builds the same model, data, optimizer and schedule.

    python -m benchmarks.startup [--rounds N]    # the figures (interleaved fresh processes)
    python -m benchmarks.startup --importtime    # the top -X importtime entries of `python -m csframework`
    python -m benchmarks.startup --importtime --side hydra   # ... of the hand-written script in a bare Hydra app

Each contestant is a fresh process that notes the wall clock, starts its child (the hand script, or
``python -m csframework ... loop.max_steps=1`` with the ``FirstStep`` plugin below enabled) and waits for it;
the child writes the wall clock at the end of its first optimizer step into the file named by
``CSF_FIRST_STEP_FILE``. The figure is the difference of the two times to first step (seconds); the whole
1-step run (the framework's end-of-run evaluation, checkpoint, curves and summary included) is reported too,
and the hand-written script inside an empty ``@hydra.main`` app: what Hydra alone costs, and the floor the
framework's time to first step is held against (``LIMIT_OVER_HYDRA_S``).
Workloads: ``mlp`` (the test fixtures' ``model=blobs_mlp data=blobs``) and ``default`` (the embedded default
tiny transformer, what ``python -m csframework`` trains without overrides).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from csframework import hookimpl

ROOT = Path(__file__).resolve().parents[1]
STAMP_ENV = "CSF_FIRST_STEP_FILE"
WORKLOADS = {"mlp": ["--config-dir", str(ROOT / "tests" / "support" / "conf"), "model=blobs_mlp", "data=blobs"],
             "default": []}
NAMES = {"mlp": "MLP", "default": "embedded default"}
LIMIT_S = 0.2
#: Issue 50 item 1: the time to first step at most this much above a bare ``@hydra.main`` script's.
LIMIT_OVER_HYDRA_S = 0.3


def write_stamp() -> None:
    """Write the wall clock and this process's CPU time so far into the file ``CSF_FIRST_STEP_FILE`` names."""
    with open(os.environ[STAMP_ENV], "w") as f:
        f.write(f"{time.time()!r} {time.process_time()!r}")


class FirstStep:
    """Writes ``time.time()`` to the file ``CSF_FIRST_STEP_FILE`` names when the first optimizer step is done:
    ``plugins.enable=[benchmarks.startup:FirstStep]``. With ``loop.max_steps=1`` that step is the stage's last,
    whose evaluation runs before ``on_train_batch_end`` (a checkpoint holds its step's metrics): the evaluation's
    start marks the step's end then, as the hand-written script, which does not evaluate, stops its clock there."""

    name = "first_step"

    def __init__(self):
        self.done = False

    def _stamp(self) -> None:
        if not self.done:
            self.done = True
            write_stamp()

    @hookimpl
    def on_eval_start(self) -> None:
        self._stamp()

    @hookimpl
    def on_train_batch_end(self) -> None:
        self._stamp()


def framework_command(workload: str, run_dir: str) -> list[str]:
    """``python -m csframework`` training ``workload`` for one step into ``run_dir``, with ``FirstStep``."""
    threads = os.environ.get("CSF_BENCH_THREADS", "1")
    return [sys.executable, "-m", "csframework", *WORKLOADS[workload], "loop.max_steps=1", f"backend.threads={threads}",
            f"hydra.run.dir={run_dir}", "plugins.enable=[benchmarks.startup:FirstStep]"]


def hand_command(workload: str, hydra: bool = False) -> list[str]:
    """The hand-written script (``hydra``: inside a bare Hydra app)."""
    return [sys.executable, str(ROOT / "benchmarks" / "startup_hand.py"), workload, *(["hydra"] if hydra else [])]


def contestant(name: str) -> dict:
    """One measurement: ``hand-<workload>``, ``csframework-<workload>`` or ``hydra-<workload>`` (the hand
    script inside a bare Hydra app); seconds from spawning the child to
    the end of its first step, and to its exit; the CPU seconds the child used up to the end of its first step
    (less disturbed by other work on the machine than the wall clock)."""
    side, workload = name.split("-", 1)
    with tempfile.TemporaryDirectory() as tmp:
        stamp = Path(tmp) / "first_step"
        command = (framework_command(workload, f"{tmp}/run") if side == "csframework" else
                   hand_command(workload, hydra=side == "hydra"))
        env = dict(os.environ, **{STAMP_ENV: str(stamp), "CSF_HYDRA_RUN_DIR": f"{tmp}/run"})
        start = time.time()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        end = time.time()
        if done.returncode != 0 or not stamp.exists():
            raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        wall, cpu = (float(v) for v in stamp.read_text().split())
        return {"first_step_s": wall - start, "first_step_cpu_s": cpu, "run_s": end - start}


def figures(rounds: int) -> list:
    """Time to first step (wall and CPU) and the whole 1-step run, on the MLP and the embedded default, each
    against the hand-written script; and, for reference, the hand-written script inside a bare Hydra app."""
    from benchmarks import harness

    result = []
    for workload in WORKLOADS:
        sides = {side: harness.python("benchmarks.startup", "--contestant", f"{side}-{workload}")
                 for side in ("csframework", "hand", "hydra")}
        runs = harness.interleaved(sides, rounds, harness.contestant_env())
        command = f"python -m benchmarks.startup --rounds {rounds}"
        for side, key, what, limit in (
                ("csframework", "first_step_s", "time to first step", LIMIT_S),
                ("csframework", "first_step_cpu_s", "CPU time to first step", None),
                ("csframework", "run_s", "whole 1-step run", None),
                ("hydra", "first_step_s", "time to first step of a bare Hydra app (reference)", None),
                ("hydra", "first_step_cpu_s", "CPU time to first step of a bare Hydra app (reference)", None)):
            result.append(harness.Figure(
                name=f"{what}, {NAMES[workload]}", unit="s", kind="difference", command=command,
                samples=[r[key] for r in runs[side]], baseline="hand-written script",
                baseline_samples=[r[key] for r in runs["hand"]],
                target=f"<= +{limit} s" if limit is not None else "", limit=limit))
        result.append(harness.Figure(
            name=f"time to first step, {NAMES[workload]}, against a bare Hydra app", unit="s", kind="difference",
            command=command, samples=[r["first_step_s"] for r in runs["csframework"]],
            baseline="the hand-written script in a bare @hydra.main app",
            baseline_samples=[r["first_step_s"] for r in runs["hydra"]], target=f"<= +{LIMIT_OVER_HYDRA_S} s",
            limit=LIMIT_OVER_HYDRA_S))
    return result


def import_times(workload: str = "default", top: int = 15, side: str = "csframework") -> str:
    """The ``top`` entries of ``python -X importtime -m csframework`` (one step of ``workload``; ``side``
    ``hydra``: of the hand-written script in a bare Hydra app) by cumulative time: the modules imported at top
    level (their imports included), then the packages other than torch's that the run imports, by their own
    time. The project's bytecode is cached first, as for the figures."""
    from benchmarks import harness

    harness.cache_bytecode()
    with tempfile.TemporaryDirectory() as tmp:
        command = framework_command(workload, f"{tmp}/run") if side == "csframework" else \
            hand_command(workload, hydra=True)
        env = dict(harness.contestant_env(), **{STAMP_ENV: f"{tmp}/stamp", "CSF_HYDRA_RUN_DIR": f"{tmp}/run"})
        done = subprocess.run([command[0], "-X", "importtime", *command[1:]], env=env, capture_output=True,
                              text=True, cwd=ROOT)
    rows = []  # (self us, cumulative us, depth, module)
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m[1]), int(m[2]), len(m[3]) // 2, m[4]))
    if done.returncode != 0 or not rows:
        raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    what = "-m csframework" if side == "csframework" else "benchmarks/startup_hand.py (bare Hydra app)"
    lines = [f"python -X importtime {what} ({workload}, 1 step): {sum(r[1] for r in rows if r[2] == 0) / 1e6:.3f} s "
             f"of imports", "", f"top {top} top-level imports by cumulative time:"]
    lines += [f"  {r[1] / 1e6:7.3f} s  {r[3]}" for r in sorted((r for r in rows if r[2] == 0), key=lambda r: -r[1])[:top]]
    torch_deps = ("torch", "torchgen", "numpy", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock",
                  "fsspec", "typing_extensions")
    by_package: dict[str, int] = {}
    for own, _, _, module in rows:
        package = module.split(".", 1)[0]
        by_package[package] = by_package.get(package, 0) + own
    others = sorted(((us, p) for p, us in by_package.items() if p not in torch_deps), reverse=True)[:top]
    lines += ["", f"top {top} packages besides torch's by own import time:"]
    lines += [f"  {us / 1e6:7.3f} s  {p}" for us, p in others]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--contestant", help="one measurement (used by the harness)")
    parser.add_argument("--importtime", action="store_true", help="print the top -X importtime entries")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="default", help="with --importtime")
    parser.add_argument("--side", choices=["csframework", "hydra"], default="csframework", help="with --importtime")
    args = parser.parse_args(argv)
    if args.contestant:
        print(json.dumps(contestant(args.contestant)))
        return
    if args.importtime:
        print(import_times(args.workload, side=args.side))
        return
    from benchmarks import harness

    print(harness.table(figures(args.rounds)))


if __name__ == "__main__":
    main()
