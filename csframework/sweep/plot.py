"""``sweep.png``: the objective against each swept key (one panel per key, a log axis for a key swept over
orders of magnitude) and every job's curve on one chart, each job in its own colour in every panel, named
with its overrides in the legend. Drawn with matplotlib when it is
installed (``pip install "csframework[plot]"``), else as ``sweep.svg`` by the SVG writer of the run curves
(``builtin.plot.svg_chart``)."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from ..builtin import plot as run_plot
from ..builtin.plot import COLOURS, WIDTH, escape, quiet_logger, read_series, svg_chart, svg_figure
from ..errors import CsfError, printable
from ..files import SafeDir
from .table import columns, job_files, row_overrides

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


def job_label(row: dict, keys: list[str] | None = None) -> str:
    """A job as the plots' legends name it: its number and its overrides of ``keys`` (the swept ones; all
    when None), as ``job 2: optimizer=adamw optimizer.lr=0.003``."""
    overrides = " ".join(f"{k}={v}" for k, v in row_overrides(row).items() if keys is None or k in keys)
    return f"job {row['job']}" + (f": {overrides}" if overrides else "")


@dataclass
class Panel:
    """The objective against one swept key, a point per job (``points``: label -> ``(x, objective)``): numbers
    (``categories`` None; ``log``: positive values over at least two orders of magnitude), else categories at
    the x positions 0, 1, ..."""

    key: str
    points: dict[str, tuple[float, float]]
    log: bool = False
    categories: list[str] | None = None

    @property
    def name(self) -> str:
        return self.key + (" (log)" if self.log else "")


def panels(rows: list[dict], objective: str) -> list[Panel]:
    """One panel per swept key, of the jobs that reported the objective."""
    found, keys = [], swept_keys(rows)
    for key in keys:
        reported = [(job_label(r, keys), r.get(key), y) for r in rows if (y := _number(r.get(objective))) is not None]
        xs = [_number(x) for _, x, _ in reported]
        if reported and all(x is not None for x in xs):
            positive = [x for x in xs if x is not None and x > 0]
            log = len(positive) == len(xs) and max(positive) / min(positive) >= 100
            found.append(Panel(key, {label: (float(x), y) for (label, _, y), x in zip(reported, xs) if x is not None},
                               log))
        else:  # a categorical key (a config group option, a string)
            labels = sorted({str(x) for _, x, _ in reported})
            found.append(Panel(key, {label: (float(labels.index(str(x))), y) for label, x, y in reported},
                               categories=labels))
    return found


def write_sweep_plot(sweep_dir: Path, rows: list[dict], objective: str = "val/loss") -> Path | None:
    """``sweep.png`` (matplotlib installed) or ``sweep.svg`` in the sweep directory; returns its path. Each job
    has its colour in every panel, named in the legend with its overrides."""
    found, keys = panels(rows, objective), swept_keys(rows)
    curve, curves = curves_of(sweep_dir, rows, objective)
    title = f"sweep: {objective} ({len(rows)} jobs)"
    labels = sorted({job_label(row, keys) for row in rows}, key=_job_order)  # a colour each, in job order
    if not run_plot.have_matplotlib():  # (one switch for both plots: tests turn it off)
        charts = [svg_chart({label: [p.points[label]] for label in labels if label in p.points},
                            escape(p.name if i else f"{title}: {p.name}"), x=i * WIDTH, x_label=escape(p.key),
                            y_label=escape(objective), lines=False, log_x=p.log, order=labels,
                            categories=[escape(c) for c in p.categories] if p.categories is not None else None)
                  for i, p in enumerate(found)]
        charts.append(svg_chart(curves, escape(title if not found else f"curves: {curve}"), x=len(found) * WIDTH,
                                y_label=escape(curve), order=labels))
        return SafeDir(sweep_dir).write(PLOT_SVG, svg_figure([c for c in charts if c]))
    return _png(sweep_dir, found, curves, title, objective, curve, labels)


def _job_order(label: str) -> tuple[int, str]:
    number = label.split(":")[0].removeprefix("job ")
    return (int(number), label) if number.isdigit() else (1 << 30, label)


def _png(sweep_dir: Path, found: list[Panel], curves: dict, title: str, objective: str, curve: str,
         labels: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    # names and values as plain text (no TeX: issue 47 item 9), matplotlib's warnings off the console
    plain: Any = {"text.parse_math": False} if "text.parse_math" in matplotlib.rcParams else {}
    with matplotlib.rc_context(plain), warnings.catch_warnings(), quiet_logger("matplotlib"):
        warnings.simplefilter("ignore")
        return _draw_png(plt, sweep_dir, found, curves, title, objective, curve, labels)


def _draw_png(plt, sweep_dir: Path, found: list[Panel], curves: dict, title: str, objective: str, curve: str,
              labels: list[str]) -> Path:
    colour = {label: COLOURS[i % len(COLOURS)] for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(found) + 1, figsize=(4.2 * (len(found) + 1), 3.6 + 0.2 * len(labels)),
                             squeeze=False)
    for ax, panel in zip(axes[0], found):
        for label, (x, y) in panel.points.items():
            ax.scatter([x], [y], color=colour[label], label=printable(label))
        if panel.log:
            ax.set_xscale("log")
        if panel.categories is not None:
            ax.set_xticks(range(len(panel.categories)), panel.categories)
        ax.set_xlabel(panel.key)
        ax.set_ylabel(objective)
    chart = axes[0][-1]
    for name, series in curves.items():
        chart.plot([s for s, _ in series], [v for _, v in series], marker=".", label=printable(name),
                   color=colour.get(name))
    chart.set_xlabel("step")
    chart.set_ylabel(curve)
    handles = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    if handles:  # one legend for the figure: a job's colour is the same in every panel
        fig.legend([handles[label] for label in labels if label in handles], [l for l in labels if l in handles],
                   loc="lower center", ncol=min(3, len(handles)), fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08 + 0.04 * ((len(handles) + 2) // 3), 1, 1))
    try:  # the panels are also written into the PNG (its "panels" text entry), for tools and tests
        with SafeDir(sweep_dir).atomic(PLOT) as f:
            fig.savefig(f, format="png", dpi=90, metadata={"panels": ", ".join(p.name for p in found),
                                                           "legend": "; ".join(l for l in labels if l in handles)})
    finally:
        plt.close(fig)
    return Path(sweep_dir) / PLOT


def curves_of(sweep_dir: Path, rows: list[dict], objective: str) -> tuple[str, dict[str, list]]:
    """``(metric, {job label: its curve})``: the objective's curve of every job from its ``metrics.csv``, or,
    where no job has more than one point of it (evaluated only at the end), its training counterpart
    (``val/loss`` -> ``train/loss``), which is logged along the way."""
    keys = swept_keys(rows)
    found = {job_label(row, keys): series for row in rows if (series := _curve(sweep_dir, row, objective))}
    trained = objective.replace("val/", "train/", 1)
    if trained != objective and all(len(series) <= 1 for series in found.values()):
        logged = {job_label(row, keys): series for row in rows if (series := _curve(sweep_dir, row, trained))}
        if any(len(series) > 1 for series in logged.values()):
            return trained, logged
    return objective, found


def _curve(sweep_dir: Path, row: dict, name: str) -> list | None:
    """The metric's curve from the ``metrics.csv`` of the row's run directory, read through ``SafeDir`` and
    only in a run directory inside the sweep directory (``job_files``); None when there is none."""
    try:
        files = job_files(sweep_dir, row)
        return read_series(files, names=(name,)).get(name) if files is not None else None
    except (OSError, ValueError, CsfError):  # absent, a link, a FIFO, not a directory
        return None
