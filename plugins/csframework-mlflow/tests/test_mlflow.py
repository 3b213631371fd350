"""csframework-mlflow against a real MLflow SQLite store: params, metric history and status of a run,
and of every job of a sweep."""
import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

import csframework as csf
from csframework.testing import RunResult

pytestmark = pytest.mark.slow
ONLY = ["mlflow"]  # entry-point plugins these runs load


def store(directory) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{directory / 'mlflow.db'}")


def runs(client, experiment="csframework"):
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return sorted(found, key=lambda r: r.info.run_name)


def history(client, run_id, name):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def assert_matches(client, mlflow_run, result):
    names = {row["name"] for row in result.metrics}
    assert set(mlflow_run.data.metrics) == names
    for name in names:
        assert history(client, mlflow_run.info.run_id, name) == result.series(name)  # both float64


def test_params_metric_history_and_status(csf_runner):
    result = csf_runner.run(["optimizer.lr=0.05"], autoload=ONLY)
    assert result.exit_code == 0, result.error
    client = store(result.output_dir.parent)
    [run] = runs(client)
    assert run.info.status == "FINISHED" and run.info.run_name == result.output_dir.name
    params = run.data.params
    assert params["optimizer.lr"] == "0.05" and params["optimizer.name"] == "sgd"
    assert params["loop.max_steps"] == "20" and params["mlflow.experiment"] == "csframework"
    assert_matches(client, run, result)
    assert [s for s, _ in history(client, run.info.run_id, "val/loss")] == [5, 10, 15, 20]


def test_logs_sooner_than_the_send_interval_go_in_one_call_and_every_metric_arrives(csf_runner, monkeypatch):
    """A log within ``SEND_INTERVAL`` of the last send waits: the store is called for the first log, before each
    checkpoint and at the end, not once a log, and holds every metric at its step."""
    import csframework_mlflow

    monkeypatch.setattr(csframework_mlflow, "SEND_INTERVAL", 3600.0)
    sends = []
    log_batch = MlflowClient.log_batch

    def counted(self, run_id, metrics=(), **kwargs):
        if metrics:
            sends.append(len(metrics))
        return log_batch(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", counted)
    result = csf_runner.run(["loop.log_every=1"], autoload=ONLY)
    assert result.exit_code == 0, result.error
    client = store(result.output_dir.parent)
    [run] = runs(client)
    assert_matches(client, run, result)
    saves = sum(e["event"] == "checkpoint_saved" for e in result.events)
    logs = len({row["step"] for row in result.metrics})
    # the first log's, then at most one before each checkpoint and one at the end (nothing may be left then)
    assert logs == 20 and saves >= 1 and 2 <= len(sends) <= 2 + saves and sum(sends) == len(result.metrics)


def test_one_mlflow_run_per_sweep_job(csf_runner):
    sweep = csf_runner.cli(["-m", "optimizer.lr=0.05,0.2"], autoload=ONLY)
    assert sweep.exit_code == 0, sweep.stderr[-3000:]
    client = store(sweep.output_dir)
    found = runs(client)
    assert [r.info.run_name for r in found] == ["0", "1"]
    assert [r.data.params["optimizer.lr"] for r in found] == ["0.05", "0.2"]
    for job, mlflow_run in zip(("0", "1"), found):
        assert mlflow_run.info.status == "FINISHED"
        assert_matches(client, mlflow_run, RunResult.read(0, sweep.output_dir / job))


class FailAt:
    @csf.hookimpl
    def on_train_batch_end(self, run):
        if run.global_step == 7:
            raise RuntimeError("boom")


def test_a_failed_run_is_failed_and_the_store_is_configurable(csf_runner, tmp_path):
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    result = csf_runner.run([f"mlflow.tracking_uri={uri}", "mlflow.experiment=tiny"], plugins=[FailAt()],
                            autoload=ONLY)
    assert result.exit_code == 1 and "FailAt" in str(result.error)
    client = MlflowClient(tracking_uri=uri)
    [run] = runs(client, "tiny")
    assert run.info.status == "FAILED"
    assert history(client, run.info.run_id, "train/loss") == result.series("train/loss")
    assert not (result.output_dir.parent / "mlflow.db").exists()


def test_a_compiled_run_logs_the_same_history(csf_runner):
    """backend.compile=true: the metric history is the run's own, step for step, and the run finishes."""
    result = csf_runner.run(["backend.compile=true"], autoload=ONLY)
    assert result.exit_code == 0, result.error
    assert result.summary["compile"]["graph_breaks"] == 0
    client = store(result.output_dir.parent)
    [run] = runs(client)
    assert run.info.status == "FINISHED"
    assert_matches(client, run, result)


def test_the_cli_run_prints_no_mlflow_store_lines(tmp_path):
    """Creating the SQLite store is MLflow's own INFO lines on stderr: they are held back, so the run's stderr is
    csframework's lines only."""
    done = subprocess.run([sys.executable, "-m", "csframework", "loop.max_steps=2", "loop.eval_every=null",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CSFRAMEWORK_PLUGINS_AUTOLOAD": "mlflow"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "mlflow.db").exists()  # the plugin ran and created its store
    assert "mlflow.store" not in done.stderr and "alembic" not in done.stderr, done.stderr
