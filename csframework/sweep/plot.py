"""``sweep.png``: the objective against each swept key (one panel per key, a log axis for a key swept over
orders of magnitude) and every job's validation curve on one chart. Drawn with matplotlib when it is
installed (``pip install "csframework[plot]"``), else as ``sweep.svg`` by the SVG writer of the run curves
(``builtin.plot.svg_chart``)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..builtin import plot as run_plot
from ..builtin.plot import WIDTH, escape, read_series, svg_chart, svg_figure
from ..errors import CsfError
from ..files import SafeDir
from .table import columns

PLOT, PLOT_SVG = "sweep.png", "sweep.svg"


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


@dataclass
class Panel:
    """The objective against one swept key: numbers (``categories`` None; ``log``: positive values over at least
    two orders of magnitude), else categories at the x positions 0, 1, ..."""

    key: str
    points: list[tuple[float, float]]
    log: bool = False
    categories: list[str] | None = None

    @property
    def name(self) -> str:
        return self.key + (" (log)" if self.log else "")


def panels(rows: list[dict], objective: str) -> list[Panel]:
    """One panel per swept key, of the jobs that reported the objective."""
    found = []
    for key in swept_keys(rows):
        points = [(r.get(key), y) for r in rows if (y := _number(r.get(objective))) is not None]
        xs = [_number(x) for x, _ in points]
        if points and all(x is not None for x in xs):
            positive = [x for x in xs if x is not None and x > 0]
            log = len(positive) == len(xs) and max(positive) / min(positive) >= 100
            found.append(Panel(key, [(float(x), y) for x, (_, y) in zip(xs, points) if x is not None], log))
        else:  # a categorical key (a config group option, a string)
            labels = sorted({str(x) for x, _ in points})
            found.append(Panel(key, [(float(labels.index(str(x))), y) for x, y in points], categories=labels))
    return found


def write_sweep_plot(sweep_dir: Path, rows: list[dict], objective: str = "val/loss") -> Path | None:
    """``sweep.png`` (matplotlib installed) or ``sweep.svg`` in the sweep directory; returns its path."""
    found = panels(rows, objective)
    curves = {f"job {row['job']}": series for row in rows if (series := _curve(sweep_dir, row, objective))}
    title = f"sweep: {objective} ({len(rows)} jobs)"
    if not run_plot.have_matplotlib():  # (one switch for both plots: tests turn it off)
        charts = [svg_chart({"": p.points}, escape(p.name if i else f"{title}: {p.name}"), x=i * WIDTH,
                            x_label=escape(p.key), y_label=escape(objective), lines=False, log_x=p.log,
                            categories=[escape(c) for c in p.categories] if p.categories is not None else None)
                  for i, p in enumerate(found)]
        charts.append(svg_chart(curves, escape(title if not found else "curves"), x=len(found) * WIDTH,
                                y_label=escape(objective)))
        return SafeDir(sweep_dir).write(PLOT_SVG, svg_figure([c for c in charts if c]))
    return _png(sweep_dir, found, curves, title, objective)


def _png(sweep_dir: Path, found: list[Panel], curves: dict, title: str, objective: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(found) + 1, figsize=(4.2 * (len(found) + 1), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], found):
        ax.scatter([x for x, _ in panel.points], [y for _, y in panel.points])
        if panel.log:
            ax.set_xscale("log")
        if panel.categories is not None:
            ax.set_xticks(range(len(panel.categories)), panel.categories)
        ax.set_xlabel(panel.key)
        ax.set_ylabel(objective)
    chart = axes[0][-1]
    for name, series in curves.items():
        chart.plot([s for s, _ in series], [v for _, v in series], marker=".", label=name)
    chart.set_xlabel("step")
    chart.set_ylabel(objective)
    if chart.lines:
        chart.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    try:  # the panels are also written into the PNG (its "panels" text entry), for tools and tests
        with SafeDir(sweep_dir).atomic(PLOT) as f:
            fig.savefig(f, format="png", dpi=90, metadata={"panels": ", ".join(p.name for p in found)})
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
