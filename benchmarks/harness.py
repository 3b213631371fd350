"""Interleaved fresh-process timing: what every figure in ``python -m benchmarks`` is measured with.

A figure compares contestants (the hand-written baseline and csframework, say). Each round starts every
contestant as a fresh Python process, in an order that alternates from round to round, so that both see
the same machine: a drift in the machine's speed lands on both sides of a ratio. A contestant is a command
that prints one JSON object on its last line of standard output; the harness keeps the values it names.

Ratios are medians of the per-round ratios (each round's two processes ran back to back), reported with the
medians and the min-max of each side. Absolute times differ from machine to machine; ratios travel.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]


def contestant_env(threads: int = 1) -> dict:
    """The environment of every contestant: ``threads`` intra-op threads (torch, OpenMP, MKL), the
    project and its test fixtures importable, no entry-point plugin of other packages."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["CSF_BENCH_THREADS"] = str(threads)
    env["CSFRAMEWORK_PLUGINS_AUTOLOAD"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support"), env.get("PYTHONPATH", "")])
    return env


def run_once(command: Sequence[str], env: dict | None = None, timeout: float = 900) -> dict:
    """Run ``command`` as a fresh process; returns the JSON object on its last line of standard output."""
    done = subprocess.run(list(command), cwd=ROOT, env=env or contestant_env(), capture_output=True, text=True,
                          timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark contestant failed (exit {done.returncode}): {' '.join(command)}\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def cache_bytecode() -> None:
    """Compile the project's modules (csframework, the benchmarks, the test fixtures) to cached bytecode, as
    a user's Python has them from its second run on (a wheel's install compiles them at once). Contestants
    then load them instead of compiling them from source: on a machine that sets
    ``PYTHONDONTWRITEBYTECODE`` (this project's development VMs do) every fresh process would otherwise
    compile csframework again, some 40 ms of start-up that no user pays."""
    import compileall

    for folder in ("csframework", "benchmarks", "tests/support"):
        compileall.compile_dir(ROOT / folder, quiet=2)


def interleaved(contestants: dict[str, Sequence[str]], rounds: int, env: dict | None = None) -> dict[str, list[dict]]:
    """Each round runs every contestant once, as a fresh process, in an order that alternates (the first
    of one round is the last of the next); returns each contestant's results, round by round. The
    project's bytecode is cached first (``cache_bytecode``)."""
    cache_bytecode()
    names = list(contestants)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            results[name].append(run_once(contestants[name], env))
    return results


def python(module: str, *args: str) -> list[str]:
    """The command that runs ``python -m <module> <args>`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


@dataclasses.dataclass
class Figure:
    """One row of the benchmark table: ``value`` of csframework against ``baseline``, round by round."""

    name: str  #: what is measured
    unit: str  #: the unit of ``samples`` (e.g. ``ms/step``)
    samples: list[float]  #: csframework's value in each round
    baseline: str = ""  #: what it is compared with ("" for an absolute figure)
    baseline_samples: list[float] = dataclasses.field(default_factory=list)
    target: str = ""  #: the issue's target, as text (``<= 1.05x``)
    limit: float | None = None  #: the target as a number: the ratio (or the value, without baseline) to stay under
    command: str = ""  #: the command that reproduces the figure alone
    kind: str = "ratio"  #: ``ratio`` (samples / baseline), ``difference`` (samples - baseline) or ``value``

    @property
    def per_round(self) -> list[float]:
        """Each round's ratio (or difference) of csframework to its baseline; empty for a ``value``."""
        if self.kind == "ratio":
            return [s / b for s, b in zip(self.samples, self.baseline_samples)]
        if self.kind == "difference":
            return [s - b for s, b in zip(self.samples, self.baseline_samples)]
        return []

    @property
    def measured(self) -> float:
        """The median of the per-round ratios (or differences), or the median value."""
        return statistics.median(self.per_round or self.samples)

    @property
    def met(self) -> bool | None:
        return None if self.limit is None else self.measured <= self.limit

    def row(self) -> dict:
        def spread(values):
            return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
        return {"figure": self.name, "unit": self.unit, "csframework": spread(self.samples),
                "baseline": self.baseline, "baseline_values": spread(self.baseline_samples),
                "kind": self.kind, "measured": self.measured, "per_round": self.per_round, "target": self.target,
                "met": self.met,
                "rounds": len(self.samples), "command": self.command}


def fmt(value: float) -> str:
    """A figure to 3-4 significant digits."""
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"


def table(figures: list[Figure]) -> str:
    """The Markdown table of ``figures``: median [min-max] of each side, the ratio (the median of the
    per-round ratios, and their min-max: how far one round's figure strays) and the target."""
    lines = ["| figure | csframework | baseline | ratio / difference | target | met |",
             "|---|---|---|---|---|---|"]
    for f in figures:
        ours = f"{fmt(statistics.median(f.samples))} [{fmt(min(f.samples))}-{fmt(max(f.samples))}] {f.unit}"
        if f.baseline_samples:
            theirs = (f"{f.baseline}: {fmt(statistics.median(f.baseline_samples))} "
                      f"[{fmt(min(f.baseline_samples))}-{fmt(max(f.baseline_samples))}] {f.unit}")
        else:
            theirs = "-"
        measured = {"ratio": f"{f.measured:.3f}x", "difference": f"{f.measured:+.3g} {f.unit}",
                    "value": "-"}[f.kind]
        if len(f.per_round) > 1:
            low, high = min(f.per_round), max(f.per_round)
            measured += f" [{low:.3f}-{high:.3f}]" if f.kind == "ratio" else f" [{low:+.3g} to {high:+.3g}]"
        met = {True: "yes", False: "**no**", None: "-"}[f.met]
        lines.append(f"| {f.name} | {ours} | {theirs} | {measured} | {f.target or '-'} | {met} |")
    return "\n".join(lines)


def machine() -> dict:
    """What the figures were measured on."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "os": f"{platform.system()} {platform.release()}"}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    info["beside_core"] = beside_core()
    return info


def beside_core() -> list[str]:
    """The installed packages that change csframework's start-up beyond what its own install brings: Hydra's
    plugins (Hydra imports every one when it composes) and ``rich`` (structlog imports it when present)."""
    from importlib.metadata import distributions

    names = {d.metadata["Name"].lower() for d in distributions()}
    return sorted(n for n in names if (n.startswith("hydra-") and n != "hydra-core") or n == "rich")
