"""The default `distrain run`, through the CLI, on a real local Ray: accuracy, files, repeatability."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import ray
import yaml
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig, flatten
from distrain.fields import SECTIONS
from distrain.orchestrator import warm_pool
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.run import Progress, run_training
from tests.helpers import assert_compact_checkpoint

pytestmark = pytest.mark.usefixtures("ray_cluster")
runner = CliRunner()


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("default") / "run"
    result = runner.invoke(app, ["run", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    return run_dir, result.output


def test_default_run_reaches_target_accuracy(default_run):
    run_dir, output = default_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final_test_accuracy"] >= 0.95
    assert summary["time_to_target_s"] is not None and 0 < summary["time_to_target_s"] <= summary["wall_time_s"]
    assert summary["steady_state_samples_per_s"] > 0
    # 2 workers, ring all-reduce of the flat float32 gradient: each sends 2(P-1)/P * n bytes.
    cfg = RunConfig.resolve(str(run_dir / "config.yaml"), {})
    ckpt = load_checkpoint(run_dir / "checkpoints" / "final.pt")
    nbytes = 4 * sum(t.numel() for t in ckpt["model"].values())
    assert summary["bytes_per_step"] == cfg.workers * nbytes
    assert "final test accuracy" in output and "final val accuracy" in output
    assert "time to val_accuracy>=0.95" in output
    assert "peak memory of a worker (host)" in output


def test_metrics_parquet_has_a_row_per_worker_step_and_per_epoch(default_run):
    run_dir, _ = default_run
    df = pd.read_parquet(run_dir / "metrics.parquet")
    steps, evals = df[df["kind"] == "step"], df[df["kind"] == "eval"]
    cfg = RunConfig.resolve(str(run_dir / "config.yaml"), {})
    n_steps = steps["step"].nunique()
    assert len(steps) == n_steps * cfg.workers
    assert sorted(steps["worker"].unique()) == list(range(cfg.workers))
    assert steps.groupby("step")["worker"].nunique().eq(cfg.workers).all()
    assert list(evals["epoch"]) == list(range(cfg.epochs))
    for col in ("run_id", "loss", "lr", "samples", "compute_s", "comm_s", "h2d_s", "wall_time"):
        assert steps[col].notna().all(), col
    assert (steps["samples"] == cfg.batch_size).all()
    assert (steps["compute_s"] > 0).all() and (steps["comm_s"] >= 0).all()
    # the batch's move to the device, timed inside compute_s: near nothing on the CPU, but recorded
    assert (steps["h2d_s"] >= 0).all() and (steps["h2d_s"] <= steps["compute_s"]).all()
    assert steps["gpu_util"].isna().all() and steps["gpu_mem_bytes"].isna().all()  # no NVML reading on the CPU
    assert evals["val_accuracy"].between(0, 1).all() and evals["val_loss"].notna().all()  # each epoch: validation
    assert evals["test_loss"].notna().tolist() == [False] * (cfg.epochs - 1) + [True]  # the test set: at the end
    assert steps.groupby("worker")["wall_time"].apply(lambda s: s.is_monotonic_increasing).all()
    assert df["run_id"].eq(run_dir.name).all()
    # Each worker's peak memory so far: a process with torch loaded (well over 50 MB), never falling;
    # no GPU figure on the CPU. summary.json keeps the largest and each worker's.
    peaks = steps.sort_values("step").groupby("worker")["mem_peak_bytes"]
    assert (peaks.min() > 50e6).all() and peaks.apply(lambda s: s.is_monotonic_increasing).all()
    assert steps["gpu_peak_bytes"].isna().all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_memory_bytes"] == steps["mem_peak_bytes"].max() and "gpu_peak_bytes" not in summary
    assert summary["peak_memory_bytes_per_worker"] == {str(int(w)): int(v) for w, v in peaks.max().items()}
    # training made progress
    first, last = (
        steps[steps["epoch"] == 0]["loss"].mean(),
        steps[steps["epoch"] == cfg.epochs - 1]["loss"].mean(),
    )
    assert last < first / 3


def test_config_yaml_and_checkpoint(default_run):
    run_dir, _ = default_run
    text = (run_dir / "config.yaml").read_text()
    data = yaml.safe_load(text)
    assert list(data) == list(SECTIONS)  # nested by section; the bsp strategy's options under its name
    assert data["strategy"]["name"] == "bsp" and data["strategy"]["bsp"]["backup_workers"] == 0
    data = flatten(data)
    assert set(data) == set(RunConfig().to_dict())
    assert data["workers"] == 2 and data["run_dir"] == str(run_dir)
    ckpt = load_checkpoint(run_dir / "checkpoints" / "final.pt")
    assert ckpt["epoch"] == data["epochs"] and ckpt["global_step"] > 0
    assert ckpt["config"]["model"] == "cnn"
    momentum = ckpt["optimizer"]["vectors"]["momentum_buffer"]
    assert momentum.numel() == sum(t.numel() for t in ckpt["model"].values()) and momentum.abs().sum() > 0
    assert_compact_checkpoint(run_dir / "checkpoints" / "final.pt")  # 1.2 MB, not 5.5 MB (issue 13)


def test_config_file_repeats_the_run_into_a_new_directory(default_run, tmp_path):
    run_dir, _ = default_run
    before = sorted(p.name for p in run_dir.iterdir())
    again = tmp_path / "again"
    result = runner.invoke(
        app, ["run", "--config", str(run_dir / "config.yaml"), "--run-dir", str(again), "--epochs", "1"]
    )
    assert result.exit_code == 0, result.output
    cfg = RunConfig.resolve(str(again / "config.yaml"), {})
    assert cfg.epochs == 1 and cfg.model == "cnn" and cfg.workers == 2
    # the first epoch of the repeat is the first epoch of the original, step for step
    a = pd.read_parquet(run_dir / "metrics.parquet")
    b = pd.read_parquet(again / "metrics.parquet")
    a0 = a[(a["kind"] == "step") & (a["epoch"] == 0)].sort_values(["step", "worker"])["loss"].to_numpy()
    b0 = b[b["kind"] == "step"].sort_values(["step", "worker"])["loss"].to_numpy()
    assert len(b0) == len(a0) and abs(a0 - b0).max() < 1e-6
    assert sorted(p.name for p in run_dir.iterdir()) == before


def _train_worker_actors_alive() -> int:
    """TrainWorker actors alive beyond the idle ones kept warm for the next run (orchestrator/warm_pool.py:
    a completed run in this shared Ray keeps its workers; which earlier runs left some depends on the order
    the tests run in)."""
    actors = ray.state.actors() if hasattr(ray, "state") else ray._private.state.actors()
    alive = sum(1 for a in actors.values() if "TrainWorker" in a["ActorClassName"] and a["State"] != "DEAD")
    return alive - warm_pool.idle_count()


def _live_placement_groups() -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


def test_interrupt_tears_down_actors_and_keeps_partial_results(tmp_path):
    run_dir = tmp_path / "interrupted"

    def stop_after_first_segment(event):
        if isinstance(event, Progress) and event.steps_done >= 10:
            raise KeyboardInterrupt

    cfg = RunConfig(run_dir=str(run_dir), segment_steps=5, epochs=3)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, stop_after_first_segment)
    assert _train_worker_actors_alive() == 0
    assert _live_placement_groups() == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_completed"] == 10
    assert len(pd.read_parquet(run_dir / "metrics.parquet")) == 20


def test_successful_run_leaves_no_actors_or_placement_groups(default_run):
    assert _train_worker_actors_alive() == 0
    assert _live_placement_groups() == 0


def test_eval_every_and_checkpoint_every_choose_the_epochs(tmp_path):
    run_dir = tmp_path / "sparse"
    # The small MLP (a tenth of the CNN's CPU a step): which epochs evaluate and checkpoint, and the step
    # count (20 an epoch: the training set less validation, and the global batch), do not depend on the model.
    run_training(RunConfig(run_dir=str(run_dir), model="mlp", epochs=5, eval_every=2, checkpoint_every=2))
    df = pd.read_parquet(run_dir / "metrics.parquet")
    assert list(df[df["kind"] == "eval"]["epoch"]) == [1, 3, 4]  # every 2nd epoch, and the last
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["epoch-0002.pt", "epoch-0004.pt", "final.pt", "latest.json"]
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["name"] == "final.pt"
    assert load_checkpoint(run_dir / "checkpoints" / "epoch-0002.pt")["global_step"] == 2 * 20
