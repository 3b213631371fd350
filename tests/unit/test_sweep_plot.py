"""``csframework.sweep.plot``: the sweep plot's panels, with matplotlib (``sweep.png``) and without
(``sweep.svg``)."""
import re

import pytest

from csframework.sweep.plot import write_sweep_plot

LABELS = ["job 0: optimizer=sgd optimizer.lr=0.0001", "job 1: optimizer=adamw optimizer.lr=0.01",
          "job 2: optimizer=sgd optimizer.lr=0.1"]


def three_jobs(tmp_path) -> list[dict]:
    rows = []
    for job, (lr, opt) in enumerate([(1e-4, "sgd"), (1e-2, "adamw"), (1e-1, "sgd")]):
        run_dir = tmp_path / str(job)
        run_dir.mkdir()
        (run_dir / "metrics.csv").write_text("step,stage,name,value\n" + "".join(
            f"{s},main,val/loss,{1.0 / (s + job + 1)}\n" for s in range(1, 4)))
        rows.append({"job": job, "optimizer": opt, "optimizer.lr": lr, "seed": 0, "status": "completed",
                     "val/loss": 1.0 / (job + 2), "global_step": 3, "wall_time_s": 1.0, "run_dir": str(run_dir)})
    return rows


def test_sweep_plot_has_one_panel_per_swept_key(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    path = write_sweep_plot(tmp_path, three_jobs(tmp_path), "val/loss")
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.text["panels"] == "optimizer, optimizer.lr (log)"  # seed took one value: no panel


def test_without_matplotlib_the_sweep_plot_is_an_svg_of_the_same_panels(tmp_path, monkeypatch):
    """Issue 29 item 6: without matplotlib, ``sweep.svg`` (drawn by the SVG writer of the run curves): a scatter
    panel per swept key (log axis for the learning rate, categories for the optimizer) and the curves."""
    from csframework.builtin import plot

    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    path = write_sweep_plot(tmp_path, three_jobs(tmp_path), "val/loss")
    assert path == tmp_path / "sweep.svg" and not (tmp_path / "sweep.png").exists()
    svg = path.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>") and svg.count("<svg") == 4  # 2 keys, curves
    assert svg.count("<circle") == 6 and svg.count("<polyline") == 3  # 3 jobs in 2 panels; 3 curves
    assert "optimizer.lr (log)" in svg and ">adamw</text>" in svg and ">sgd</text>" in svg
    assert "seed" not in svg  # seed took one value: no panel, not in the legend


def test_each_job_has_its_own_colour_in_every_panel_and_a_legend_with_its_overrides(tmp_path, monkeypatch):
    """Issue 39 item 6: sgd and adamw told apart: each job its colour, the same in every panel of sweep.svg,
    and the legend names each job with its swept settings."""
    from csframework.builtin import plot

    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    svg = write_sweep_plot(tmp_path, three_jobs(tmp_path), "val/loss").read_text()
    charts = svg.split("<svg")[2:]
    legends = [dict((label, colour) for colour, label in re.findall(r'fill="(#[0-9a-f]{6})">(job [^<]+)</text>', chart))
               for chart in charts]
    assert [sorted(legend) for legend in legends] == [LABELS] * 3, legends
    assert all(legend == legends[0] for legend in legends) and len(set(legends[0].values())) == 3
    for chart in charts[:2]:  # each job's point in its colour
        assert sorted(re.findall(r'<circle [^>]*fill="(#[0-9a-f]{6})"', chart)) == sorted(legends[0].values())


def test_with_matplotlib_the_legend_names_each_job_with_its_overrides(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    path = write_sweep_plot(tmp_path, three_jobs(tmp_path), "val/loss")
    from PIL import Image

    with Image.open(path) as image:
        assert image.text["legend"] == "; ".join(LABELS)


def test_the_curves_panel_falls_back_to_training_when_the_objective_was_evaluated_once(tmp_path, monkeypatch):
    """A sweep evaluated at its end only has one val/loss point per job: its curves panel draws train/loss."""
    from csframework.builtin import plot

    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    rows = three_jobs(tmp_path)
    for row in rows:
        metrics = "".join(f"{s},main,train/loss,{2.0 / s}\n" for s in range(1, 4)) + "3,main,val/loss,0.5\n"
        (tmp_path / str(row["job"]) / "metrics.csv").write_text("step,stage,name,value\n" + metrics)
    svg = write_sweep_plot(tmp_path, rows, "val/loss").read_text()
    curves = svg.split("<svg")[-1]
    assert "curves: train/loss" in curves and curves.count("<polyline") == 3


def test_sweep_png_draws_names_and_values_as_plain_text_without_warnings(tmp_path):
    """Issue 47 item 9: a swept value and an objective with TeX in them (``$\\undefined$``) are text, not a
    failing mathtext parse; matplotlib's warnings stay off the console."""
    import warnings

    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    rows = three_jobs(tmp_path)
    for row in rows:
        row["$\\undefined$"] = row.pop("val/loss")
        row["optimizer"] = "$\\undefined$ " + row["optimizer"] + "x" * 300
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = write_sweep_plot(tmp_path, rows, "$\\undefined$")
    assert path == tmp_path / "sweep.png"
    assert [str(w.message) for w in caught if "matplotlib" in w.filename] == []
