"""The curves of a run, drawn from ``metrics.csv``: every metric, one panel per family (``train/loss`` and
``val/loss`` in ``loss``, the accuracies in ``accuracy``, ``lr``, ``steps_per_sec`` ...): ``curves.png`` with
matplotlib when it is installed (``pip install csframework[plot]``), else ``curves.svg``, drawn by hand
without dependencies. A series of one point (a one-step run) is drawn as a marker."""
from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import logging
import math
import textwrap
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from ..errors import UnsafePathError, printable
from ..files import SafeDir

def escape(text: str) -> str:
    """``text`` safe inside an SVG element: a run id or stage name cannot add markup."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]
WIDTH, HEIGHT, PAD = 640, 360, 48


MAX_POINTS = 1000  # per curve: a long run's CSV is thinned as it is read, so memory stays bounded


def read_series(metrics_csv: Path | SafeDir, names: Sequence[str] | None = ("train/loss", "val/loss"),
                ) -> dict[str, list[tuple[int, float]]]:
    """The curves named ``names`` (``None``: every metric) from a ``metrics.csv`` (a path, or a run
    directory's ``SafeDir``, read through no link); rows that are not ``step,stage,name,value`` with numbers
    are skipped."""
    series: dict[str, list[tuple[int, float]]] = {}
    stride: dict[str, list[int]] = {}  # name -> [keep every n-th row, rows seen]
    raw = metrics_csv.reader("metrics.csv") if isinstance(metrics_csv, SafeDir) else open(metrics_csv, "rb")
    with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="") as f:
        for row in _rows(f):
            if row.get("name") is not None and (names is None or row["name"] in names):
                try:
                    step, value = int(row["step"]), float(row["value"])
                except (TypeError, ValueError):
                    continue
                if math.isfinite(value):
                    every = stride.setdefault(row["name"], [1, 0])
                    every[1] += 1
                    if (every[1] - 1) % every[0]:
                        continue
                    points = series.setdefault(row["name"], [])
                    points.append((step, value))
                    if len(points) >= 2 * MAX_POINTS:  # keep every other point from now on
                        points[:] = points[::2]
                        every[0] *= 2
    return series


#: A ``metrics.csv`` line longer than this is no row csframework wrote (a step, a stage, a name and a number):
#: skipped, as a field beyond ``csv``'s own limit (131072 characters) would stop the reader with an error
MAX_ROW_CHARS = 4096


def _rows(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """The rows of a ``metrics.csv`` (untrusted: others may have written it), lines too long for a row left
    out; a line ``csv`` cannot parse (a NUL byte, a quote left open) ends the rows there."""
    try:
        yield from csv.DictReader(line for line in lines if len(line) <= MAX_ROW_CHARS)
    except csv.Error:
        return


def _tick(value: float) -> str:
    """An axis label: a whole number as itself (a step), anything else to 3 significant digits."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e6 else f"{value:.3g}"


def svg_chart(series: Mapping[str, Sequence[tuple[float, float]]], title: str = "", *, x: int = 0, y: int = 0,
              x_label: str = "step", y_label: str = "", lines: bool = True, log_x: bool = False,
              categories: list[str] | None = None, order: Sequence[str] | None = None) -> str:
    """The one SVG writer (curves.svg, sweep.svg): a chart of each series (``{name: [(x, value), ...]}``) as an
    ``<svg>`` element ``x`` pixels from the left and ``y`` from the top of its document (alone, a document
    itself), with axis ranges, labels and a legend. ``lines=False`` draws markers only (a scatter); ``log_x`` a log10 x axis (positive
    x only); ``categories`` names the x positions 0, 1, ... (a key whose values are not numbers). A series of
    one point is drawn as a marker. ``order``: the names in the order their colours are given (the same in
    every chart of a figure); sorted by name when not given. Text is escaped by the caller (``escape``)."""
    if log_x:
        series = {name: [(math.log10(px), v) for px, v in values] for name, values in series.items()}
    points = [p for values in series.values() for p in values]
    if not points:
        return ""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def xy(px, value):
        return (PAD + (px - x0) / (x1 - x0) * (WIDTH - 2 * PAD),
                HEIGHT - PAD - (value - y0) / (y1 - y0) * (HEIGHT - 2 * PAD))

    def label(px):
        return _tick(10 ** px if log_x else px)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" x="{x}" y="{y}" width="{WIDTH}" height="{HEIGHT}" '
             f'font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{PAD}" y="20">{title}</text>',
             f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
             f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end">{y0:.3g}</text>',
             f'<text x="{PAD - 4}" y="{PAD + 4}" text-anchor="end">{y1:.3g}</text>']
    if y_label:
        parts.append(f'<text x="{PAD}" y="{PAD - 8}">{y_label}</text>')
    if categories is not None:
        parts += [f'<text x="{xy(i, y0)[0]:.1f}" y="{HEIGHT - PAD + 16}" text-anchor="middle">{name}</text>'
                  for i, name in enumerate(categories)]
        parts.append(f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 32}" text-anchor="end">{x_label}</text>')
    else:
        log = " (log)" if log_x else ""
        parts += [f'<text x="{PAD}" y="{HEIGHT - PAD + 16}">{label(x0)}</text>',
                  f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 16}" text-anchor="end">'
                  f'{x_label}{log} {label(x1)}</text>']
    names = [n for n in order if n in series] + sorted(set(series) - set(order)) if order else sorted(series)
    legend_x = max(PAD + 8, WIDTH - PAD - 7 * max((len(n) for n in names), default=0))
    for i, name in enumerate(names):
        values = series[name]
        colour = COLOURS[(list(order).index(name) if order and name in order else i) % len(COLOURS)]
        if lines:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in (xy(s, v) for s, v in values))
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        if not lines or len(values) == 1:  # a line of one point draws nothing
            for px, py in (xy(*point) for point in values):
                parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{colour}"/>')
        if name:
            parts.append(f'<text x="{legend_x}" y="{PAD + 16 * i}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def svg_figure(charts: list[str], columns: int | None = None, title: str = "") -> str:
    """``svg_chart`` elements in one document: side by side (made with ``x=`` 0, ``WIDTH``, ``2 * WIDTH`` ...),
    or in a grid of ``columns`` (made at ``grid_place``), under ``title`` (escaped by the caller)."""
    columns = columns or max(len(charts), 1)
    rows = -(-len(charts) // columns)
    top = TITLE_HEIGHT if title else 0
    head = [f'<text x="{PAD}" y="{16 + 18 * k}" font-family="sans-serif" font-size="14">{line}</text>'
            for k, line in enumerate(title.splitlines()[:2])]
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH * min(columns, len(charts) or 1)}" '
                      f'height="{HEIGHT * rows + top}">', *head, *charts, "</svg>"])


#: The most panels a row of ``curves.png`` / ``curves.svg`` holds: a grid a person reads, not a strip.
GRID_COLUMNS = 3
TITLE_HEIGHT = 40


def grid_place(i: int, title: bool = True) -> tuple[int, int]:
    """The ``(x, y)`` of the ``i``-th panel of a curves grid (``GRID_COLUMNS`` a row, under the title)."""
    return (i % GRID_COLUMNS) * WIDTH, (i // GRID_COLUMNS) * HEIGHT + (TITLE_HEIGHT if title else 0)


def short_text(text: str, limit: int = 60) -> str:
    """``text`` for a label: no control character (``printable``: none reaches the font), at most ``limit``
    characters. matplotlib draws it with ``parse_math=False`` (``png_curves``): a set named ``$\\undefined$``
    is text, not TeX."""
    text = printable(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


Series = Sequence[tuple[float, float]]


def families(series: Mapping[str, Series]) -> dict[str, dict[str, Series]]:
    """``series`` grouped by metric family, the name after ``train/`` or ``val/`` (``loss`` first, then the
    model's other outputs, then ``lr`` and ``steps_per_sec``): one panel each."""
    grouped: dict[str, dict[str, Sequence[tuple[float, float]]]] = {}
    for name, values in series.items():
        grouped.setdefault(name.split("/", 1)[-1], {})[name] = values
    last = ("lr", "steps_per_sec")
    return {f: grouped[f] for f in sorted(grouped, key=lambda f: (f != "loss", f in last, last.index(f) if f in last
                                                                    else 0, f))}


def svg_curves(series: Mapping[str, Sequence[tuple[float, float]]], title: str = "") -> str:
    """A line plot per metric family (step on x, value on y), ``GRID_COLUMNS`` a row, with axis ranges and
    legends, under ``title`` (escaped by the caller)."""
    grouped = families(series)
    charts = [svg_chart(group, family, x=grid_place(i)[0], y=grid_place(i)[1], y_label=family)
              for i, (family, group) in enumerate(grouped.items())]
    return svg_figure(charts, min(GRID_COLUMNS, len(charts)), title or " ")


def have_matplotlib() -> bool:
    """Whether matplotlib is installed and imports: a broken install (its import raising) means the SVG
    plot, as no matplotlib does, not a run failing at its end."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    try:
        import matplotlib.figure  # noqa: F401
        import matplotlib.ticker  # noqa: F401
    except Exception:  # noqa: BLE001 - whatever a broken install raises
        return False
    return True


def png_curves(series: dict[str, list[tuple[int, float]]], out, title: str = "") -> None:
    """``series`` drawn with matplotlib's object API (no pyplot: the user's backend and figures are left
    alone) into ``out`` (a binary file), a panel per metric family (``families``), ``GRID_COLUMNS`` a row,
    under ``title`` (its lines). Every name is drawn as plain text (no TeX: ``short_text``), and matplotlib's own
    warnings (a layout it cannot fit) stay off the console: the figure is drawn as well as it can be."""
    import warnings

    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    grouped = families(series)
    columns = min(GRID_COLUMNS, len(grouped))
    rows = -(-len(grouped) // columns)
    # the title wrapped to the figure's width (about 90 characters a panel), 4 lines at most
    lines = [wrapped for line in title.splitlines() for wrapped in textwrap.wrap(
        short_text(line, 1000), 90 * columns, break_long_words=False, break_on_hyphens=False) or [""]][:4]
    fig = Figure(figsize=(WIDTH / 100 * columns, HEIGHT / 100 * rows + 0.2 * len(lines)), dpi=100)
    with warnings.catch_warnings(), quiet_logger("matplotlib"):
        warnings.simplefilter("ignore")
        for i, (family, group) in enumerate(grouped.items()):
            ax = fig.add_subplot(rows, columns, i + 1)
            for j, (name, values) in enumerate(sorted(group.items())):
                ax.plot([s for s, _ in values], [v for _, v in values], color=COLOURS[j % len(COLOURS)],
                        label=short_text(name), marker="o" if len(values) == 1 else None)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("step")
            ax.set_ylabel(short_text(family, 40), parse_math=False)
            ax.grid(alpha=0.3)
            for text in ax.legend(fontsize="small").get_texts():
                text.set_parse_math(False)
        fig.suptitle("\n".join(lines), fontsize=10, parse_math=False)
        fig.tight_layout()
        fig.savefig(out, format="png")


@contextlib.contextmanager
def quiet_logger(name: str):
    """The logger ``name`` (a library's: matplotlib's font lookups) says nothing below ERROR meanwhile."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def write_curves(run_dir: SafeDir, title: str = "") -> Path | None:
    """``curves.png`` (matplotlib installed) or ``curves.svg`` in ``run_dir`` (atomically, through no
    link); ``None`` without metrics."""
    try:
        series = read_series(run_dir, names=None)
    except (OSError, ValueError, UnsafePathError):  # none, or no regular file (a planted link): no curves
        return None
    if not any(series.values()):
        return None
    if have_matplotlib():
        with run_dir.atomic("curves.png", durable=False) as f:
            png_curves(series, f, title)
        return run_dir / "curves.png"
    return run_dir.write("curves.svg", svg_curves(series, escape(title)), durable=False)
