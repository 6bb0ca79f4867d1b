"""The MLflow logger (`--loggers mlflow`): a run's figures (orchestrator/loggers.py) as an MLflow run's
metrics, its config as the run's parameters, its status when it ends.

The tracking URI is --mlflow-uri, by default a SQLite database beside the run directories
(`loggers.default_mlflow_uri`: no server; MLflow's file store is legacy). Written through an
`MlflowClient` of its own, not the `mlflow.start_run` global: a notebook's own active run is left alone.
Metrics are buffered and sent in batches at each evaluation and at the end (one database transaction per
batch, not per step). The MLflow run's id and tracking URI are kept in RUN_DIR/mlflow_run.json, so a
resumed run (from a --storage copy too) goes on logging to the same MLflow run. Needs the `mlflow` extra
(mlflow-skinny with SQLAlchemy and Alembic).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from distrain.errors import ConfigError
from distrain.orchestrator.callbacks import RunInfo
from distrain.orchestrator.loggers import Logger

EXPERIMENT = "distrain"
RUN_FILE = "mlflow_run.json"
BATCH = 1000  # MLflow's limit of metrics per log_batch call
VALUE_CHARS = 500  # ... and of a parameter value's length
STATUS = {"completed": "FINISHED", "stopped": "FINISHED", "interrupted": "KILLED"}  # anything else: FAILED


class MlflowLogger(Logger):
    def __init__(self, uri: str) -> None:
        super().__init__()
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError("--loggers mlflow needs MLflow: pip install 'distrain[mlflow]'") from None
        self._client_class = MlflowClient
        self.uri = uri
        self.buffer: list[Any] = []

    def open(self, info: RunInfo) -> None:
        from mlflow.entities import Param

        self.record = info.run_dir / RUN_FILE
        if self.record.exists():  # a resumed run: the same MLflow run, where it is (unless --mlflow-uri moved it)
            recorded = json.loads(self.record.read_text())
            self.run_id, self.uri = recorded["run_id"], self.uri or recorded["tracking_uri"]
            self.client = self._client_class(tracking_uri=self.uri)
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.uri = self.uri or default_mlflow_uri(info.run_dir)
        self.client = self._client_class(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(EXPERIMENT)
        run = self.client.create_run(experiment_id, run_name=info.run_dir.name)
        self.run_id = run.info.run_id
        self.record.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": self.uri}) + "\n")
        params = [
            Param(k, str(v)[:VALUE_CHARS]) for k, v in info.config.to_dict().items() if v not in ("", None, [], {})
        ]
        for i in range(0, len(params), 100):  # MLflow's limit of parameters per call
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.buffer.extend(Metric(name, value, now, step) for name, value in values.items())

    def flush(self) -> None:
        for i in range(0, len(self.buffer), BATCH):
            self.client.log_batch(self.run_id, metrics=self.buffer[i : i + BATCH])
        self.buffer = []

    def close(self, summary: dict[str, Any]) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=STATUS.get(str(summary.get("status")), "FAILED"))


def default_mlflow_uri(run_dir: Path) -> str:
    """--loggers mlflow without --mlflow-uri: one SQLite database beside the run directories (runs/), so the
    runs of one folder compare in one MLflow experiment, with no server (MLflow's file store is legacy)."""
    return f"sqlite:///{run_dir.resolve().parent / 'mlflow.db'}"
