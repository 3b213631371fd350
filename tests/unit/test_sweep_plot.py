"""``csframework.sweep.plot``: the sweep plot's panels, with matplotlib (``sweep.png``) and without
(``sweep.svg``)."""
import pytest

from csframework.sweep.plot import write_sweep_plot


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
    assert "job 0" in svg and "job 2" in svg and "seed" not in svg  # seed took one value: no panel
