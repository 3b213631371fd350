"""``csframework.builtin.plot``: the run's curves, every metric in a panel per family, ``curves.png`` with
matplotlib, else a hand-drawn ``curves.svg``; a one-step run's series is a marker."""
import re
import warnings

import pytest

import csframework as csf
import fixtures
from csframework.builtin import plot

pytestmark = pytest.mark.curves  # (runs draw their curves: tests/conftest.py)


def one_step(tmp_path):
    csf.Run(fixtures.compose("loop.max_steps=1", "loop.log_every=1"), output_dir=tmp_path).fit()


def test_without_matplotlib_a_one_step_run_draws_a_marker_per_series_in_svg(tmp_path, monkeypatch):
    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    one_step(tmp_path)
    svg = (tmp_path / "curves.svg").read_text()
    metrics = ("train/loss", "val/loss", "train/accuracy", "val/accuracy", "lr", "steps_per_sec")
    assert svg.count("<circle") == len(metrics) and all(f">{name}</text>" in svg for name in metrics)
    assert not (tmp_path / "curves.png").exists()


def test_with_matplotlib_a_one_step_run_draws_curves_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    drawn = []
    real = plot.png_curves
    monkeypatch.setattr(plot, "png_curves", lambda series, path, title="": (drawn.append(series),
                                                                              real(series, path, title)))
    one_step(tmp_path)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "curves.svg").exists()
    assert {name: len(points) for name, points in drawn[0].items()} == {
        "train/loss": 1, "val/loss": 1, "train/accuracy": 1, "val/accuracy": 1, "lr": 1, "steps_per_sec": 1}


def test_a_matplotlib_that_fails_to_import_draws_the_svg_and_the_run_completes(tmp_path, monkeypatch):
    """A broken install (its import raises ImportError). Before (issue 37): the run failed at its end."""
    import sys

    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # ``import matplotlib.figure`` raises ImportError
    run = csf.Run(fixtures.compose("loop.max_steps=1", "loop.log_every=1"), output_dir=tmp_path)
    assert run.fit()["status"] == "completed"
    assert "train/loss" in (tmp_path / "curves.svg").read_text() and not (tmp_path / "curves.png").exists()


def test_curves_show_every_metric_in_a_panel_per_family(tmp_path, monkeypatch):
    """Issue 39 item 6: the accuracy the model reports is drawn too, not only the losses: a panel per metric
    family (train and val of one output together), losses first."""
    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)  # the fallback without the plot extra
    cfg = fixtures.compose("loop.max_steps=6", "loop.log_every=2", "loop.eval_every=3")
    csf.Run(cfg, output_dir=tmp_path).fit()
    svg = (tmp_path / "curves.svg").read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    charts = svg.split("<svg")[2:]
    titles = [chart.split('y="20">')[1].split("</text>")[0] for chart in charts]
    assert titles == ["loss", "accuracy", "lr", "steps_per_sec"], titles
    assert ">train/loss</text>" in charts[0] and ">val/loss</text>" in charts[0]
    assert ">train/accuracy</text>" in charts[1] and ">val/accuracy</text>" in charts[1]
    assert svg.count("<polyline") == 6


def test_with_matplotlib_curves_png_has_a_panel_per_family(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    series = {"train/loss": [(1, 1.0), (2, 0.5)], "val/accuracy": [(2, 0.7)], "train/accuracy": [(1, 0.5)],
              "lr": [(1, 0.1), (2, 0.1)]}
    assert list(plot.families(series)) == ["loss", "accuracy", "lr"]
    with open(tmp_path / "curves.png", "wb") as f:
        plot.png_curves(series, f, "run")
    from PIL import Image

    with Image.open(tmp_path / "curves.png") as image:
        assert image.size[0] == 3 * plot.WIDTH  # three panels side by side


SIX = {name: [(1, 1.0), (2, 0.5)] for name in ("train/loss", "val/loss", "train/accuracy", "val/f1", "val/recall",
                                               "lr", "steps_per_sec")}  # 6 families


@pytest.mark.parametrize("families", [1, 3, 4, 6])
def test_the_curves_are_a_grid_of_at_most_three_panels_a_row(tmp_path, families):
    """Issue 50 item 5: not a strip of panels 3200 px wide: 3 a row at most, the rows below, under the title."""
    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    from PIL import Image

    series = dict(list(SIX.items())[:families + 1 if families > 1 else 2])
    assert len(plot.families(series)) == families
    with open(tmp_path / "curves.png", "wb") as f:
        plot.png_curves(series, f, "2026-11-28/21-20-00 (completed, run abc)\noptimizer.lr=0.01")
    rows, columns = -(-families // 3), min(families, 3)
    with Image.open(tmp_path / "curves.png") as image:
        width, height = image.size
    assert width == columns * plot.WIDTH and rows * plot.HEIGHT <= height < (rows + 1) * plot.HEIGHT
    svg = plot.svg_curves(series, "run")
    assert f'width="{columns * plot.WIDTH}" height="{rows * plot.HEIGHT + plot.TITLE_HEIGHT}"' in svg
    places = {(c * plot.WIDTH, r * plot.HEIGHT + plot.TITLE_HEIGHT) for r in range(rows) for c in range(columns)}
    assert {(int(x), int(y)) for x, y in re.findall(r'<svg [^>]*x="(\d+)" y="(\d+)"', svg)} == \
        set(list(sorted(places, key=lambda p: (p[1], p[0])))[:families])


class StrangeNames:
    """Reports metrics whose names matplotlib would parse as TeX, or cannot lay out (300 characters)."""

    name = "strange_names"

    @csf.hookimpl
    def on_train_batch_end(self, run):
        run.report({"$\\undefined$/loss": 1.0, "x" * 300 + "/loss": 2.0, "val/$x^2$": 0.5})


def test_metric_and_set_names_are_plain_text_and_no_library_warning_reaches_the_console(tmp_path, capfd):
    """Issue 47 item 9: a name with TeX in it (an evaluation set named ``$\\undefined$``) failed the run while
    drawing ``curves.png``; a 300-character one let matplotlib's ``Tight layout not applied`` reach the console."""
    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = csf.Run(fixtures.compose("loop.max_steps=2", "loop.log_every=1"), output_dir=tmp_path,
                      plugins=[StrangeNames()])
        assert run.fit()["status"] == "completed"
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [str(w.message) for w in caught if "matplotlib" in w.filename] == []
    err = capfd.readouterr().err
    assert "Warning" not in err and "matplotlib" not in err, err[-2000:]


def test_the_curves_title_names_the_run_and_the_settings_that_differ(tmp_path, monkeypatch):
    from csframework.builtin import metrics

    class Run:
        output_dir, run_id = tmp_path / "2026-11-28" / "21-20-00", "abc123"

    monkeypatch.setattr(metrics, "composed_overrides", lambda: ["optimizer.lr=0.01", "model=blobs_mlp"])
    assert metrics.curves_title(Run, "completed") == \
        "2026-11-28/21-20-00 (completed, run abc123)\noptimizer.lr=0.01 model=blobs_mlp"
    monkeypatch.setattr(metrics, "composed_overrides", lambda: [])
    assert metrics.curves_title(Run, "failed").endswith("(failed, run abc123)\ndefault settings")
    monkeypatch.setattr(metrics, "composed_overrides", lambda: None)  # a run from Python: nothing recorded
    assert metrics.curves_title(Run, "completed") == "2026-11-28/21-20-00 (completed, run abc123)"


def test_a_planted_metrics_csv_line_never_fails_the_run_that_draws_it(tmp_path, monkeypatch):
    """``metrics.csv`` is untrusted: a line with a field beyond csv's limit (131072 characters) made the curves'
    reader raise in ``on_fit_end``, and a completed fit (its checkpoints written) said ``failed``. Lines too
    long to be a row are skipped; a line csv cannot parse ends the rows read."""
    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    overrides = ("loop.max_steps=2", "loop.log_every=1", "loop.eval_every=null")
    csf.Run(fixtures.compose(*overrides), output_dir=tmp_path).fit()
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("2,main,planted," + "y" * 200_000 + "\n")
    summary = csf.Run(fixtures.compose("loop.max_steps=3", "loop.log_every=1", "loop.eval_every=null",
                                       "checkpoint.resume=auto"), output_dir=tmp_path).fit()
    assert summary["status"] == "completed" and summary["global_step"] == 3
    series = plot.read_series(tmp_path / "metrics.csv")
    assert [step for step, _ in series["train/loss"]] == [1, 2, 3]
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write('4,main,"train/loss,1.0\n')  # a quote never closed: the rows end there
    assert [step for step, _ in plot.read_series(tmp_path / "metrics.csv")["train/loss"]] == [1, 2, 3]
