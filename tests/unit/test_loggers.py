"""--loggers: the figures each back end (tensorboard, csv, mlflow) writes, read back from its own files,
against the means of the rows the driver's hooks were given (no Ray: the hooks are called here)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.orchestrator.callbacks import RunInfo
from distrain.orchestrator.logger_choice import build_loggers
from tests.tensorboard_events import read_scalars

# Two workers, three global steps, rows arriving out of order and per segment; the task logs `acc`
# (absent from worker 1's rows of step 2: averaged over the rows that have it) and `tokens`.
SEGMENTS = [
    {"worker": [0, 0], "step": [0, 1], "loss": [1.0, 0.8], "lr": [0.1, 0.1], "samples": [4, 4],
     "wall_time": [0.1, 0.2], "train_acc": [0.5, 0.6], "train_tokens": [10.0, None]},
    {"worker": [1, 1, 1], "step": [0, 1, 2], "loss": [3.0, 1.2, 0.4], "lr": [0.1, 0.1, 0.05], "samples": [4, 4, 4],
     "wall_time": [0.1, 0.2, 0.3], "train_acc": [0.7, 0.8, None], "train_tokens": [30.0, 20.0, 5.0]},
    {"worker": [0], "step": [2], "loss": [float("nan")], "lr": [0.05], "samples": [4], "wall_time": [0.3],
     "train_acc": [0.9], "train_tokens": [7.0]},
]  # fmt: skip
EXPECTED = {  # step (completed) -> name -> value
    1: {"train/loss": 2.0, "train/lr": 0.1, "train/acc": 0.6, "train/tokens": 20.0},
    2: {"train/loss": 1.0, "train/lr": 0.1, "train/acc": 0.7, "train/tokens": 20.0},
    3: {"train/loss": 0.4, "train/lr": 0.05, "train/acc": 0.9, "train/tokens": 6.0},  # NaN loss: not averaged
}
TESTS = {"test_loss": 0.25, "test_accuracy": 0.875, "test_perplexity": 1.284}


def drive(run_dir: Path, config: RunConfig, status: str = "completed") -> None:
    """The driver's hooks, as a run of two workers calls them."""
    loggers = build_loggers(config)
    info = RunInfo(run_dir, config, total_steps=3, steps_per_epoch=3, start_step=0, num_params=10, target=None)
    for logger in loggers:
        logger.on_run_start(info)
        for rows in SEGMENTS:
            logger.on_rows(rows)
        logger.on_epoch_end(0, TESTS | {"train_loss": 0.4, "steps_done": 3, "elapsed_s": 1.0})
        logger.on_run_end({"status": status})


def expected_points() -> dict[tuple[str, int], float]:
    points = {(name, step): value for step, values in EXPECTED.items() for name, value in values.items()}
    return points | {(f"test/{name.removeprefix('test_')}", 3): value for name, value in TESTS.items()}


def without_speed(points: dict[str, dict[int, float]]) -> dict[tuple[str, int], float]:
    """`points` less samples/s (checked here), flat: (name, step) -> value."""
    speed = points.pop("train/samples_per_s")
    # once per batch of steps written: steps 1-2 with the second segment, step 3 with the third
    assert list(speed) == [2, 3] and all(v > 0 for v in speed.values())
    return {(name, step): value for name, steps in points.items() for step, value in steps.items()}


def test_tensorboard_and_csv_hold_each_step_s_means_and_the_evaluation(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    drive(run_dir, RunConfig(loggers="tensorboard, csv", tensorboard=str(tmp_path / "tb")))
    with (run_dir / "scalars.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "name", "value"]
    from_csv: dict[str, dict[int, float]] = {}
    for step, name, value in rows[1:]:
        from_csv.setdefault(name, {})[int(step)] = float(value)
    assert without_speed(from_csv) == pytest.approx(expected_points())
    for logdir in (run_dir / "tensorboard", tmp_path / "tb" / "r1"):  # --loggers's, and --tensorboard DIR's
        scalars = {tag: dict(points) for tag, points in read_scalars(logdir).items()}
        assert without_speed(scalars) == pytest.approx(expected_points(), rel=1e-6)  # float32 in the events


def test_mlflow_holds_the_run_s_metrics_params_and_status(tmp_path):
    pytest.importorskip("mlflow")  # the mlflow extra (in dev)
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "r2"
    run_dir.mkdir(parents=True)
    drive(run_dir, RunConfig(loggers="mlflow", lr=0.25), status="stopped")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")  # the default
    runs = client.search_runs([client.get_experiment_by_name("distrain").experiment_id])
    assert [r.info.run_name for r in runs] == ["r2"]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.25"
    points = {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)} for name in run.data.metrics
    }
    assert without_speed(points) == pytest.approx(expected_points())
    # A resumed run logs to the same MLflow run (RUN_DIR/mlflow_run.json)
    drive(run_dir, RunConfig(loggers="mlflow"), status="failed")
    assert [r.info.status for r in client.search_runs([run.info.experiment_id])] == ["FAILED"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"loggers": "csv,wandb"}, "--loggers: unknown logger 'wandb'; choose from tensorboard, csv, mlflow"),
        ({"mlflow_uri": "sqlite:///x.db"}, "--mlflow-uri is for --loggers mlflow"),
    ],
)
def test_bad_loggers_are_refused_with_the_flag_named(changes, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        RunConfig(**changes).validate()


def test_a_task_s_logged_scalars_come_back_as_floats_and_bad_ones_are_refused():
    import torch

    from distrain.trainers.local_trainer import logged_values, split_loss
    from distrain.trainers.task import Task, loss_only

    task = Task()
    loss = torch.tensor(2.0, requires_grad=True)
    assert split_loss(task, loss) == (loss, None) and loss_only(loss) is loss
    got, logs = split_loss(task, (loss, {"acc": torch.tensor(0.5), "n": 3}))
    assert got is loss and logged_values(task, logs) == {"acc": 0.5, "n": 3.0}
    assert loss_only((loss, logs)) is loss
    with pytest.raises(TypeError, match="must be a dict"):
        logged_values(task, [1.0])
    with pytest.raises(TypeError, match="not all numbers"):
        logged_values(task, {"v": torch.ones(3)})
    assert math.isnan(logged_values(task, {"x": float("nan")})["x"])
