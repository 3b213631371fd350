"""MLflow tracking for csframework: one MLflow run per csframework run (so one per job of a sweep) with
the composed config as params, every reported metric at its step, and the run's status. The default
store is a SQLite file beside the run directory (``<run dir>/../mlflow.db``), so the jobs of a sweep
share one store. Only rank 0 writes. A resumed run continues the same MLflow run (its id is kept in the
checkpoint). Metrics go to the store in one batch at most every ``SEND_INTERVAL`` seconds (a log
after that is sent at once), and before a checkpoint is saved and when the run ends or fails: a call to
the store costs milliseconds, more than a small model's step."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Optional

import csframework as csf
from csframework.config import flat_config

__all__ = ["MlflowLogger", "MlflowConfig"]
_BATCH = 100  # MLflow's limit of params per log_batch call
_METRICS_BATCH = 1000  # and of metrics
#: Seconds: a log this long after the last send is sent at once; sooner ones wait for the next such log
#: (or a checkpoint, or the run's end). A send to a SQLite store takes 5-7 ms: one a log on the tiny MLP
#: (log_every=25, 0.4 ms steps) made a run 1.6 times as long.
SEND_INTERVAL = 1.0
#: The loggers through which MLflow announces, at INFO on stderr, that it creates or migrates a SQLite store.
_STORE_LOGGERS = ("mlflow.store.db.utils", "alembic")


@contextlib.contextmanager
def _quiet_store_setup():
    """MLflow's store creation lines held back (WARNING and above still pass) while the store is opened: a run's
    stderr has csframework's lines only."""
    loggers = [logging.getLogger(name) for name in _STORE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@dataclass
class MlflowConfig:
    tracking_uri: Optional[str] = None
    """An MLflow tracking URI; ``null``: ``sqlite:///<the run directory's parent>/mlflow.db``."""
    experiment: str = "csframework"
    """The MLflow experiment (created if missing)."""


class MlflowLogger:
    """The plugin (entry point ``mlflow``, config section ``mlflow``)."""

    name = "mlflow"

    def __init__(self):
        self.client = None
        self.run_id: str | None = None
        self.pending: list = []  # mlflow.entities.Metric not sent yet
        self.sent = 0.0  # time.monotonic() of the last send

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"mlflow": MlflowConfig}

    @csf.hookimpl
    def on_checkpoint_load(self, state):
        self.run_id = (state.get(self.name) or {}).get("run_id")

    @csf.hookimpl
    def on_checkpoint_save(self, state):
        self._send()  # the store holds the metrics of the steps a checkpoint holds
        if self.run_id is not None:
            state[self.name] = {"run_id": self.run_id}

    @csf.hookimpl
    def on_fit_start(self, run):
        if run.rank != 0:
            return
        with _quiet_store_setup():
            self._start(run)

    def _start(self, run) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        cfg = run.config.mlflow
        uri = cfg.tracking_uri
        if uri is None:
            parent = run.output_dir.resolve().parent
            parent.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{parent / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        if self.run_id is not None:  # resumed: continue the MLflow run the checkpoint names
            try:
                self.client.update_run(self.run_id, status="RUNNING")
                return
            except MlflowException:
                run.log.warning("mlflow_run_not_found", run_id=self.run_id, tracking_uri=uri,
                                action="starting a new MLflow run")
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment)
        created = self.client.create_run(experiment_id, run_name=run.output_dir.name,
                                         tags={"csframework.output_dir": str(run.output_dir),
                                               "csframework.run_id": run.run_id})
        self.run_id = created.info.run_id
        params = [Param(key, str(value)) for key, value in flat_config(run.config).items()]
        for start in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + _BATCH])

    @csf.hookimpl
    def on_log_metrics(self, metrics, step):
        if self.client is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)  # (each metric keeps the time it was logged at)
            self.pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]
            if time.monotonic() - self.sent >= SEND_INTERVAL:
                self._send()

    def _send(self) -> None:
        """The metrics not sent yet, to the store, in as few ``log_batch`` calls as MLflow takes."""
        pending, self.pending = self.pending, []
        if self.client is not None:
            for start in range(0, len(pending), _METRICS_BATCH):
                self.client.log_batch(self.run_id, metrics=pending[start:start + _METRICS_BATCH])
        self.sent = time.monotonic()

    @csf.hookimpl
    def on_fit_end(self, run):
        if self.client is not None:
            self._send()
            if run.stop_reason:
                self.client.set_tag(self.run_id, "csframework.stop_reason", run.stop_reason)
            self.client.set_terminated(self.run_id, "FINISHED")
            self.client = None

    @csf.hookimpl
    def on_exception(self, error):
        if self.client is not None:
            self._send()
            self.client.set_terminated(self.run_id, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
            self.client = None
