"""Issue 30's Ray Data input, on the session's Ray (8 logical CPUs: 2 workers leave Ray Data 6): a task
whose training set is a Ray Dataset read from Parquet files this test writes (tests/raydata_task.py:
`read_parquet`; the task's `collate_columns` makes each batch of columns tensors) trains for one epoch

- through `distrain.fit` under BSP, the test set map-style: every training row is read exactly once in
  the epoch (the ids each worker's batches held), 20 steps of 2 x 32 rows, to a stated accuracy;
- through `distrain run --task path.py:Name` under local SGD, the test set a Ray Dataset too: the
  evaluation scores every test row once (the recorded figures equal the final model's, recomputed here
  on the whole test set), and the run says how many CPUs Ray Data streams on;
- through `distrain.fit` under DiLoCo: every training row once in the epoch, the outer steps on time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import distrain
from distrain.cli import app
from tests.helpers import final_params
from tests.raydata_task import DigitsStream, features, write_digits

pytestmark = pytest.mark.usefixtures("ray_cluster")
TASK = f"{Path(__file__).parents[1] / 'raydata_task.py'}:DigitsStream"
ROWS = 1280  # 20 steps of 2 workers x 32 rows: every row is in a step
RUN = {"workers": 2, "batch_size": 32, "epochs": 1, "lr": 0.1, "segment_steps": 10}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("parquet")
    write_digits(folder, ROWS)
    return folder


def test_bsp_through_fit_reads_every_row_once(data, tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    args = {"data_dir": str(data), "seen_dir": str(seen)}
    result = distrain.fit(TASK, task_args=args, run_dir=str(tmp_path / "run"), progress=False, **RUN)
    assert result.status == "completed", result.summary
    metrics = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    steps = metrics[metrics["kind"] == "step"]
    assert sorted(steps["step"].unique()) == list(range(20))
    assert steps.groupby("worker")["samples"].sum().to_dict() == {0: ROWS // 2, 1: ROWS // 2}
    ids = sorted(int(i) for f in seen.glob("*.txt") for i in f.read_text().split())
    assert ids == list(range(ROWS))  # every row once: no row twice, none left out
    assert len(list(seen.glob("*.txt"))) == 2  # read by the two workers, each its own shard
    assert result.summary["final_test_accuracy"] >= 0.8, result.summary
    assert steps.sort_values("step")["loss"].iloc[0] > 3 * result.summary["final_test_loss"]


def test_local_sgd_through_the_cli_streams_the_test_set_too(data, tmp_path):
    run_dir = tmp_path / "run"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in RUN.items()]
    result = CliRunner().invoke(
        app,
        ["run", "--task", TASK, "--task-arg", f"data_dir={data}", "--task-arg", "stream_test=true"]
        + ["--strategy", "local-sgd", "--tau", "4", "--run-dir", str(run_dir), *flags],
    )
    assert result.exit_code == 0, result.output
    assert "Ray Data streams the training set (1280 rows) on the 6 CPU(s) the workers leave free" in result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_test_accuracy"] >= 0.8, summary
    # The final model scored here on every test row: the run's streamed evaluation saw each exactly once.
    model = DigitsStream().build_model()
    flat, at = final_params(run_dir), 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[at : at + p.numel()].view_as(p))
            at += p.numel()
        test = features({k: v.to_numpy() for k, v in pd.read_parquet(data / "test.parquet").items()})
        logits = model(torch.from_numpy(test["x"]))
        y = torch.from_numpy(test["y"])
        loss = float(torch.nn.functional.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    assert summary["final_test_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert summary["final_test_loss"] == pytest.approx(loss, rel=1e-5)


def test_diloco_through_fit_reads_every_row_once(data, tmp_path):
    """DiLoCo over the streamed training set: each worker's inner steps take its own shard of
    `streaming_split`, the outer steps every H = 5 inner steps; every row once in the epoch, 4 outer steps."""
    seen = tmp_path / "seen"
    seen.mkdir()
    args = {"data_dir": str(data), "seen_dir": str(seen)}
    result = distrain.fit(
        TASK, task_args=args, strategy="diloco", sync_every=5, run_dir=str(tmp_path / "run"), progress=False, **RUN
    )
    assert result.status == "completed", result.summary
    assert result.summary["outer_steps"] == 4
    steps = pd.read_parquet(tmp_path / "run" / "metrics.parquet").query("kind == 'step'")
    assert sorted(steps["step"].unique()) == list(range(20))
    assert steps.groupby("worker")["samples"].sum().to_dict() == {0: ROWS // 2, 1: ROWS // 2}
    ids = sorted(int(i) for f in seen.glob("*.txt") for i in f.read_text().split())
    assert ids == list(range(ROWS))  # every row once: no row twice, none left out
    assert len(list(seen.glob("*.txt"))) == 2
    assert steps.sort_values("step")["loss"].iloc[0] > 2 * result.summary["final_test_loss"], result.summary
