"""Instructions per training step, counted by Valgrind's callgrind: ``Run.fit()`` with the default plugins
against the hand-written loop over pre-made batches, on the tiny MLP (``benchmarks.loop_overhead``'s own
contestants, unchanged).

Why a count and not a time: on a shared 2-core VM one configuration timed twice can differ by 10%, so the
CPU-time figures cannot resolve a change of a few per cent in the loop's own work; the number of
instructions a step executes does not depend on what else the machine runs. It is not time (a cache miss
costs more than an add): it answers "how much more work does the framework do per step", the timed figures
"how much longer does it take".

Each side runs twice under callgrind, for ``STEPS[0]`` and ``STEPS[1]`` timed steps after the contestant's
own warm-up: the same epochs (two of 256 batches), a log every 25 steps, the same set-up and the checkpoint
at the end. The difference of the two totals over the difference of the steps is a step's count; set-up
and tear-down cancel, provided nothing else grows with the run. Two things would, and are left out:

* the loss curves drawn at the end (``--no-curves``): matplotlib's font rendering grows with the points;
* the garbage collector's full passes over the set-up's objects (``--freeze-gc``: collected and frozen
  after the warm-up): one pass costs millions of instructions and falls inside one run's steps and not
  the other's. Without this, two runs of this module read 1.066x and 1.034x.

Hashing is seeded (``PYTHONHASHSEED=0``), so dictionaries grow alike in every run. Needs ``valgrind`` on the
PATH; four processes, at most two at a time (callgrind runs a program some 50 times slower), about 10
minutes on 2 cores.

    python -m benchmarks.instructions                 # the figure
    python -m benchmarks.instructions --functions 20  # and the functions whose counts differ most
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks import harness, loop_overhead

MODULE = "benchmarks.instructions"  #: this module (``__name__`` is ``__main__`` under ``python -m``)
#: Timed steps of the two runs of each side: both within the tiny MLP's second epoch, multiples of the log.
STEPS = (300, 500)
SIDES = {"hand": "hand-written loop, pre-made batches", "framework": "csframework"}


def callgrind_command(out_file: Path, side: str, steps: int) -> list[str]:
    """``loop_overhead``'s contestant ``side`` on the tiny MLP over pre-made batches, without the end-of-run
    curves and with the set-up's objects frozen, under callgrind."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
            *loop_overhead.command("--contestant", side, "--model", "tiny", "--data", "premade",
                                   "--steps", str(steps), "--no-curves", "--freeze-gc")]


def total(out_file: Path) -> int:
    """The instructions a callgrind output file counts in all (its ``totals:`` or ``summary:`` line)."""
    with open(out_file, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    raise ValueError(f"{out_file} has no totals line: not a callgrind output file, or callgrind was killed")


def per_step(totals: dict[int, int], steps: tuple[int, int] = STEPS) -> float:
    """A step's instructions: the difference of the runs' totals over the difference of their steps."""
    return (totals[steps[1]] - totals[steps[0]]) / (steps[1] - steps[0])


def by_function(out_file: Path) -> collections.Counter:
    """Instructions by function (exclusive), from ``callgrind_annotate``."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out_file)],
                          capture_output=True, text=True, check=True).stdout
    counts: collections.Counter = collections.Counter()
    for line in text.splitlines():
        match = re.match(r"\s*([\d,]+) \([^)]*\)\s+(.+?)(?: \[.*\])?$", line)
        if match and "PROGRAM TOTALS" not in line:
            counts[match.group(2)] += int(match.group(1).replace(",", ""))
    return counts


def step_difference(files: dict[tuple[str, int], Path], steps: tuple[int, int] = STEPS) -> list[tuple[float, str]]:
    """Per function, the framework's instructions per step less the hand-written loop's, largest first."""
    counts = {key: by_function(path) for key, path in files.items()}
    def step(side: str, name: str) -> float:
        return (counts[side, steps[1]][name] - counts[side, steps[0]][name]) / (steps[1] - steps[0])
    names = set().union(*counts.values())
    return sorted(((step("framework", n) - step("hand", n), n) for n in names), reverse=True)


def measure(workdir: Path, steps: tuple[int, int] = STEPS) -> dict[tuple[str, int], Path]:
    """Run the four callgrind processes (at most two at once); their output files by (side, steps)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on the PATH: install it (apt install valgrind) to count instructions")
    files = {(side, n): workdir / f"callgrind.{side}.{n}" for side in SIDES for n in steps}
    env = harness.contestant_env() | {"PYTHONHASHSEED": "0"}  # the same hashing, so the same dict layouts

    def run(key):
        command = callgrind_command(files[key], *key)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        list(pool.map(run, files))
    return files


def figure(files: dict[tuple[str, int], Path], steps: tuple[int, int] = STEPS) -> harness.Figure:
    counts = {side: per_step({n: total(files[side, n]) for n in steps}, steps) for side in SIDES}
    return harness.Figure(
        name="instructions per training step (tiny MLP, callgrind)", unit="instructions/step",
        samples=[counts["framework"]], baseline=SIDES["hand"], baseline_samples=[counts["hand"]],
        command=f"python -m {MODULE}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", type=int, default=0, metavar="N",
                        help="also the N functions whose per-step counts differ most between the sides")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="csf-callgrind-") as tmp:
        files = measure(Path(tmp))
        result = figure(files)
        print(harness.table([result]))
        extra = result.samples[0] - result.baseline_samples[0]
        print(f"\ncsframework executes {extra:+,.0f} instructions a step ({result.measured:.3f}x the hand-written loop's)")
        if args.functions:
            print(f"\nper step, csframework less the hand-written loop, by function (top {args.functions}):")
            for difference, name in step_difference(files)[:args.functions]:
                print(f"{difference:+12,.0f}  {name}")


if __name__ == "__main__":
    main()
