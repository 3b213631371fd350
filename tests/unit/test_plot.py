"""``csframework.builtin.plot``: the run's curves, every metric in a panel per family, ``curves.png`` with
matplotlib, else a hand-drawn ``curves.svg``; a one-step run's series is a marker."""
import pytest

import csframework as csf
import fixtures
from csframework.builtin import plot


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
    assert titles[0].endswith(": loss") and titles[1:] == ["accuracy", "lr", "steps_per_sec"], titles
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
