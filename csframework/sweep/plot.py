"""``sweep.png``: the objective against each swept key (one panel per key, a log axis for a key swept over
orders of magnitude) and every job's validation curve on one chart. Needs matplotlib
(``pip install "csframework[plot]"``); without it one line says so and the table is unaffected."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from ..builtin.plot import read_series
from ..errors import CsfError
from ..files import SafeDir
from .table import columns

PLOT = "sweep.png"


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def swept_keys(rows: list[dict]) -> list[str]:
    """The overridden keys that take more than one value across the jobs."""
    keys = columns(rows)
    keys = keys[1:keys.index("status")]
    return [k for k in keys if len({str(r.get(k)) for r in rows}) > 1]


def write_sweep_plot(sweep_dir: Path, rows: list[dict], objective: str = "val/loss") -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write('csframework: sweep.png needs matplotlib: pip install "csframework[plot]" '
                         "(sweep.csv is written without it)\n")
        return None
    keys = swept_keys(rows)
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(4.2 * (len(keys) + 1), 3.6), squeeze=False)
    panels: list[str] = []  # also written into the PNG (its "panels" text entry), for tools and tests
    for ax, key in zip(axes[0], keys):
        panels.append(key)
        points = [(r.get(key), _number(r.get(objective))) for r in rows]
        points = [(x, y) for x, y in points if y is not None]
        xs = [_number(x) for x, _ in points]
        if points and all(x is not None for x in xs):
            positive = [x for x in xs if x > 0]
            if len(positive) == len(xs) and max(positive) / min(positive) >= 100:
                ax.set_xscale("log")
                panels[-1] += " (log)"
            ax.scatter(xs, [y for _, y in points])
        else:  # a categorical key (a config group option, a string)
            labels = sorted({str(x) for x, _ in points})
            ax.scatter([labels.index(str(x)) for x, _ in points], [y for _, y in points])
            ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(key)
        ax.set_ylabel(objective)
    curves = axes[0][-1]
    for row in rows:
        series = _curve(sweep_dir, row, objective)
        if series:
            curves.plot([s for s, _ in series], [v for _, v in series], marker=".", label=f"job {row['job']}")
    curves.set_xlabel("step")
    curves.set_ylabel(objective)
    if curves.lines:
        curves.legend(fontsize="small")
    fig.suptitle(f"sweep: {objective} ({len(rows)} jobs)")
    fig.tight_layout()
    try:
        with SafeDir(sweep_dir).atomic(PLOT) as f:
            fig.savefig(f, format="png", dpi=90, metadata={"panels": ", ".join(panels)})
    finally:
        plt.close(fig)
    return Path(sweep_dir) / PLOT


def _curve(sweep_dir: Path, row: dict, objective: str) -> list | None:
    """The objective's curve from the ``metrics.csv`` of the row's run directory, read through
    ``SafeDir`` and only in a run directory inside the sweep directory (the table is not trusted to name
    files elsewhere); None when there is none."""
    sweep = os.path.abspath(sweep_dir)
    rel = os.path.relpath(os.path.abspath(str(row.get("run_dir"))), sweep)
    if rel == "." or rel.split(os.sep)[0] == "..":
        return None
    try:
        return read_series(SafeDir(sweep, *rel.split(os.sep)), names=(objective,)).get(objective)
    except (OSError, ValueError, CsfError):  # absent, a link, a FIFO, not a directory
        return None
