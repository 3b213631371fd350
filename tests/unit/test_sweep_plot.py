"""``csframework.sweep.plot``: the sweep plot's panels, and one line saying how to install matplotlib
without it."""
import pytest

from csframework.sweep.plot import write_sweep_plot


def test_sweep_plot_has_one_panel_per_swept_key(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install csframework[plot]) is not installed")
    rows = []
    for job, (lr, opt) in enumerate([(1e-4, "sgd"), (1e-2, "adamw"), (1e-1, "sgd")]):
        run_dir = tmp_path / str(job)
        run_dir.mkdir()
        (run_dir / "metrics.csv").write_text("step,stage,name,value\n" + "".join(
            f"{s},main,val/loss,{1.0 / (s + job + 1)}\n" for s in range(1, 4)))
        rows.append({"job": job, "optimizer": opt, "optimizer.lr": lr, "seed": 0, "status": "completed",
                     "val/loss": 1.0 / (job + 2), "global_step": 3, "wall_time_s": 1.0, "run_dir": str(run_dir)})
    path = write_sweep_plot(tmp_path, rows, "val/loss")
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.text["panels"] == "optimizer, optimizer.lr (log)"  # seed took one value: no panel


def test_without_matplotlib_one_line_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    rows = [{"job": 0, "optimizer.lr": 0.1, "status": "completed", "run_dir": str(tmp_path / "0")}]
    assert write_sweep_plot(tmp_path, rows) is None and not (tmp_path / "sweep.png").exists()
    assert capsys.readouterr().err == ('csframework: sweep.png needs matplotlib: pip install "csframework[plot]" '
                                       "(sweep.csv is written without it)\n")
