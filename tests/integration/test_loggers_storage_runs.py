"""Issue 30's loggers and --storage acceptance, on the session's real Ray and a real S3 server on
localhost (moto): a task logging scalars of its own runs through `distrain run` with every logger and
--storage s3://...; its local run directory is then deleted, and `distrain.fit(resume=s3://...)` trains it
further from the bucket's copy, synced back; `distrain report` and `distrain.load_model` read the bucket.
Each logger's figures are read back from its own files and held to the run's metrics.parquet."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import distrain
from distrain.cli import app
from distrain.orchestrator.storage import filesystem, local_copy_of
from tests.s3_server import s3_bucket  # noqa: F401 - the fixture
from tests.tensorboard_events import read_scalars

pytestmark = pytest.mark.usefixtures("ray_cluster")
TASK = f"{Path(__file__).parent.parent / 'logging_task.py'}:LoggingRegression"
B = 16  # per worker: 128 training samples, 4 steps an epoch at 2 x 16


def read_remote(uri: str) -> bytes:
    filesystem_, path = filesystem(uri)
    with filesystem_.open_input_stream(path) as f:
        return f.read()


def per_step_means(metrics: pd.DataFrame, column: str) -> dict[int, float]:
    steps = metrics[metrics["kind"] == "step"]
    return {int(s) + 1: float(v) for s, v in steps.groupby("step")[column].mean().items()}


def test_a_run_on_s3_with_every_logger_resumes_and_reports_from_the_bucket(tmp_path, s3_bucket):  # noqa: F811
    runs, storage = tmp_path / "runs", f"{s3_bucket}/runs"
    flags = ["--task", TASK, "--workers", "2", "--batch-size", str(B), "--epochs", "1", "--checkpoint-steps", "2"]
    result = CliRunner().invoke(
        app,
        ["run", *flags, "--run-dir", str(runs / "r"), "--storage", storage, "--loggers", "csv,tensorboard,mlflow"],
    )
    assert result.exit_code == 0, result.output
    first = json.loads(read_remote(f"{storage}/r/summary.json"))
    assert first["status"] == "completed" and first["steps_completed"] == 4
    assert json.loads(read_remote(f"{storage}/r/checkpoints/latest.json"))["name"] == "final.pt"

    shutil.rmtree(runs / "r")  # what follows reads the bucket's copy only
    resumed = distrain.fit(resume=f"{storage}/r", epochs=2, progress=False)
    assert resumed.status == "completed" and resumed.summary["steps_completed"] == 8
    summary = json.loads(read_remote(f"{storage}/r/summary.json"))  # synced back to where it came from
    assert summary["steps_completed"] == 8 and summary["final_test_loss"] == resumed.summary["final_test_loss"]

    metrics = pd.read_parquet(io.BytesIO(read_remote(f"{storage}/r/metrics.parquet")))
    steps = metrics[metrics["kind"] == "step"]
    assert sorted(steps["step"].unique()) == list(range(8)) and len(steps) == 16  # both runs' rows, 2 a step
    assert (steps["train_rows"] == B).all()  # the task's own scalars, per worker row
    assert steps["train_mse"].tolist() == pytest.approx(steps["loss"].tolist(), rel=1e-6)
    loss = per_step_means(metrics, "loss")

    # csv: both runs' rows in one file, the resumed run's after the first's
    with io.StringIO(read_remote(f"{storage}/r/scalars.csv").decode()) as f:
        rows = [(int(s), n, float(v)) for s, n, v in list(csv.reader(f))[1:]]
    assert {s: v for s, n, v in rows if n == "train/loss"} == pytest.approx(loss)
    assert {s: v for s, n, v in rows if n == "train/rows"} == {s: B for s in loss}
    test_loss = [v for _, n, v in rows if n == "test/loss"]
    assert test_loss[-1] == pytest.approx(summary["final_test_loss"])
    # tensorboard: the events (of both runs) in the bucket's copy, read from the resumed run's local copy
    scalars = read_scalars(Path(resumed.run_dir) / "tensorboard")
    assert dict(scalars["train/mse"]) == pytest.approx(loss, rel=1e-5)
    # mlflow: one MLflow run for both (the resumed run found its id in mlflow_run.json)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("distrain").experiment_id])
    assert run.info.run_name == "r" and run.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx(loss)

    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", f"{storage}/r", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    # Named as the user named it: the URI, not the local copy the report read (orchestrator/storage.py).
    assert "| r | bsp | 2 |" in text and f"- `r`: `{storage}/r`" in text
    assert str(local_copy_of(f"{storage}/r")) not in text and str(Path(resumed.run_dir)) not in text
    model = distrain.load_model(f"{storage}/r")
    final = torch.load(io.BytesIO(read_remote(f"{storage}/r/checkpoints/final.pt")), weights_only=False)
    for name, value in model.state_dict().items():
        assert torch.equal(value, final["model"][name])
