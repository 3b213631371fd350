"""``csframework.builtin.plot``: the loss curves, ``curves.png`` with matplotlib, else a hand-drawn
``curves.svg``; a one-step run's series is a marker."""
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
    assert svg.count("<circle") == 2 and "train/loss" in svg and "val/loss" in svg
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
    assert {name: len(points) for name, points in drawn[0].items()} == {"train/loss": 1, "val/loss": 1}


def test_a_matplotlib_that_fails_to_import_draws_the_svg_and_the_run_completes(tmp_path, monkeypatch):
    """A broken install (its import raises ImportError). Before (issue 37): the run failed at its end."""
    import sys

    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # ``import matplotlib.figure`` raises ImportError
    run = csf.Run(fixtures.compose("loop.max_steps=1", "loop.log_every=1"), output_dir=tmp_path)
    assert run.fit()["status"] == "completed"
    assert "train/loss" in (tmp_path / "curves.svg").read_text() and not (tmp_path / "curves.png").exists()


def test_curves_svg_plots_train_and_val_loss(tmp_path, monkeypatch):
    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)  # the fallback without the plot extra
    cfg = fixtures.compose("loop.max_steps=6", "loop.log_every=2", "loop.eval_every=3")
    csf.Run(cfg, output_dir=tmp_path).fit()
    svg = (tmp_path / "curves.svg").read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count("<polyline") == 2 and "train/loss" in svg and "val/loss" in svg
