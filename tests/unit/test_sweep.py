"""The sweep modules: the plot's panels, each parallel job's share of the cores, the table's columns."""
import os

from omegaconf import OmegaConf

from csframework.sweep.job import default_threads
from csframework.sweep.plot import write_sweep_plot
from csframework.sweep.table import columns, make_row, read_rows, record_row


def test_sweep_plot_has_one_panel_per_swept_key(tmp_path):
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


def test_parallel_jobs_share_the_cores():
    cores = os.cpu_count()
    assert default_threads(OmegaConf.create({"launcher": {"n_jobs": 2}})) == max(1, cores // 2)
    assert default_threads(OmegaConf.create({"launcher": {"n_jobs": -1}})) == 1  # joblib: one job per core
    assert default_threads(OmegaConf.create({"launcher": {"_target_": "BasicLauncher"}})) is None


def test_a_row_per_job_replaced_on_rerun_with_the_columns_in_order(tmp_path):
    record_row(tmp_path, make_row(1, ["optimizer.lr=0.1"], "failed", None, 1.0, tmp_path / "1"))
    record_row(tmp_path, make_row(0, ["optimizer.lr=0.2", "+extra=1"], "completed",
                                  {"metrics": {"val/loss": 0.5}, "global_step": 8}, 2.0, tmp_path / "0"))
    rows = record_row(tmp_path, make_row(1, ["optimizer.lr=0.1"], "completed",
                                         {"metrics": {"val/loss": 0.4}, "global_step": 8}, 3.0, tmp_path / "1"))
    assert [(r["job"], r["status"]) for r in rows] == [(0, "completed"), (1, "completed")] == [
        (r["job"], r["status"]) for r in read_rows(tmp_path)]
    assert columns(rows) == ["job", "optimizer.lr", "extra", "status", "val/loss", "global_step", "wall_time_s",
                             "run_dir"]
    assert (tmp_path / "sweep.csv").read_text().splitlines()[0] == ",".join(columns(rows))


def test_without_matplotlib_one_line_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    rows = [{"job": 0, "optimizer.lr": 0.1, "status": "completed", "run_dir": str(tmp_path / "0")}]
    assert write_sweep_plot(tmp_path, rows) is None and not (tmp_path / "sweep.png").exists()
    assert capsys.readouterr().err == ('csframework: sweep.png needs matplotlib: pip install "csframework[plot]" '
                                       "(sweep.csv is written without it)\n")
