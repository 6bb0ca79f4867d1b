"""`distrain tune` end to end: real Tune sweeps on the session's 8-CPU Ray, each trial a real run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig
from distrain.orchestrator.trial_resources import trial_cpus

pytestmark = pytest.mark.usefixtures("ray_cluster")
runner = CliRunner()
CONFIG_COLUMNS = ["batch_size", "lr_scaling", "warmup_epochs", "lr", "workers", "strategy"]


def tune(*args: str) -> str:
    result = runner.invoke(app, ["tune", "--model", "mlp", *args])
    assert result.exit_code == 0, result.output
    return result.output


def summary(run_dir: str) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def test_grid_results_best_yaml_resource_accounting_and_strategy_fields(tmp_path, ray_cluster):
    """A 2x2 grid (batch size x strategy, one of them on a PS shard) of 2-worker, 1-epoch runs.

    Each bsp trial needs 2 x 1.5 + 0.01 CPUs, each ssp trial one more for its shard: on 8 CPUs at
    most two run at once, and never two ssp ones. Without a bundle per actor Tune would start all four.
    --staleness 1 goes only to the strategy that reads it: the ssp trials have it, the bsp ones none.
    The trial count is printed before the cluster line, and the time left once the first trial ends."""
    sweep = tmp_path / "sweep"
    output = tune(
        "--batch-sizes", "16,32", "--strategies", "bsp,ssp", "--staleness", "1", "--epochs", "1", "--workers", "2",
        "--cpus-per-worker", "1.5", "--target-accuracy", "0.5", "--sweep-dir", str(sweep),
    )  # fmt: skip
    assert output.index("4 trial(s), grid search") < output.index("cluster ")
    assert "1/4 done, ~" in output and "4/4 done" in output
    results = pd.read_parquet(sweep / "results.parquet")
    assert len(results) == 4 and len(pd.read_csv(sweep / "results.csv")) == 4
    for column in CONFIG_COLUMNS + ["final_accuracy", "time_to_target_s", "samples_per_s", "stopped_early", "run_dir"]:
        assert column in results.columns
    assert set(zip(results["batch_size"], results["strategy"], strict=True)) == {
        (16, "bsp"), (32, "bsp"), (16, "ssp"), (32, "ssp")
    }  # fmt: skip
    by_strategy = results.groupby("strategy")["staleness"]
    assert by_strategy.apply(lambda v: v.isna().all()).to_dict() == {"bsp": True, "ssp": False}
    assert (results.loc[results["strategy"] == "ssp", "staleness"] == 1).all()
    assert (results["status"] == "completed").all() and not results["stopped_early"].any()
    assert (results["workers"] == 2).all() and (results["final_accuracy"] > 0.5).all()

    # each row describes the run in its own directory
    for _, row in results.iterrows():
        recorded = RunConfig.from_mapping(RunConfig.load_yaml(Path(row["run_dir"]) / "config.yaml"))
        assert (recorded.batch_size, recorded.strategy) == (row["batch_size"], row["strategy"])
        if row["strategy"] == "ssp":
            assert recorded.options_of("ssp").staleness == 1
        else:
            assert "staleness" not in recorded.to_dict()
        assert (Path(row["run_dir"]) / "metrics.parquet").is_file()
        # the sweep selects on validation; the test set's figure is reported apart
        assert summary(row["run_dir"])["final_val_accuracy"] == pytest.approx(row["final_accuracy"])
        assert summary(row["run_dir"])["final_test_accuracy"] == pytest.approx(row["test_accuracy"])
        assert summary(row["run_dir"])["time_to_target_s"] == pytest.approx(row["time_to_target_s"])

    # sorted by the objective: every trial reached 0.5, fastest first
    assert results["time_to_target_s"].is_monotonic_increasing

    # best.yaml is the best trial's configuration, with a fresh run directory
    best = RunConfig.from_mapping(RunConfig.load_yaml(sweep / "best.yaml"))
    first = RunConfig.from_mapping(RunConfig.load_yaml(Path(results["run_dir"][0]) / "config.yaml"))
    assert best.run_dir == "" and best.to_dict() == first.to_dict() | {"run_dir": ""}
    assert "best.yaml" in output and "distrain run --config" in output

    # resource accounting: each trial held a bundle per actor, and concurrent trials fit the cluster
    capacity = ray_cluster.cluster_resources()["CPU"]
    windows = []
    for _, row in results.iterrows():
        need = trial_cpus(RunConfig.from_mapping(RunConfig.load_yaml(Path(row["run_dir"]) / "config.yaml")))
        assert row["reserved_cpus"] == pytest.approx(need)  # 3.01 (bsp) or 4.01 (ssp + shard)
        s = summary(row["run_dir"])
        windows.append((s["started_at"], s["started_at"] + s["wall_time_s"], need))
    for start, _, _ in windows:
        running = sum(need for s, e, need in windows if s <= start < e)
        assert running <= capacity + 1e-6, (running, windows)


@pytest.mark.serial  # beside another test file's runs, the lr 50 trial has run all 3 epochs before ASHA stopped it
def test_asha_stops_an_absurd_learning_rate_early(tmp_path, ray_cluster):
    """lr 50 diverges; ASHA (grace period 1, halving, rungs at epochs 1 and 2) compares it at epoch 1
    with the lr 0.05 trial that ran before it (one trial at a time) and stops it; the good trial runs
    all 3 epochs."""
    sweep = tmp_path / "sweep"
    tune(
        "--lr", "0.05,50", "--epochs", "3", "--scheduler", "asha", "--grace-period", "1",
        "--max-concurrent-trials", "1", "--objective", "final_accuracy", "--sweep-dir", str(sweep),
        # skip: the absurd rate's non-finite steps are left out, so that trial lives to be judged at a rung
        # (with the default, stop, it ends itself at its first non-finite step, before ASHA can stop it)
        "--param", "on_nonfinite=skip",
        # segments shorter than an epoch (20 steps, as long as the default segment): when ASHA's verdict on
        # epoch 1 comes, the rest of the run is not all handed out yet, so the stop lands before its end
        "--param", "segment_steps=5",
    )  # fmt: skip
    results = pd.read_csv(sweep / "results.csv").set_index("lr")
    assert results.loc[0.05, "status"] == "completed" and results.loc[0.05, "epochs_completed"] == 3
    assert results.loc[50.0, "status"] == "stopped" and bool(results.loc[50.0, "stopped_early"])
    assert results.loc[50.0, "epochs_completed"] < 3
    assert summary(results.loc[50.0, "run_dir"])["status"] == "stopped"  # its callback stopped it cleanly
    assert (Path(results.loc[50.0, "run_dir"]) / "metrics.parquet").is_file()
    assert RunConfig.from_mapping(RunConfig.load_yaml(sweep / "best.yaml")).lr == 0.05
    # ASHA and the objective compared the trials on validation; the test set is reported apart
    assert (results["metric"] == "val_accuracy").all()
    completed = summary(results.loc[0.05, "run_dir"])
    assert results.loc[0.05, "final_accuracy"] == pytest.approx(completed["final_val_accuracy"])
    assert results.loc[0.05, "test_accuracy"] == pytest.approx(completed["final_test_accuracy"])
    # the stopped trial's actors and placement group are gone: the whole cluster is free again
    deadline = time.time() + 30
    while ray_cluster.available_resources().get("CPU", 0) < ray_cluster.cluster_resources()["CPU"]:
        assert time.time() < deadline, ray_cluster.available_resources()
        time.sleep(0.5)


def test_resume_restarts_an_interrupted_sweep(tmp_path):
    """Interrupt a sweep (Tune's Ctrl-C handling, via SIGUSR1) while its first trial runs, one trial
    at a time; --resume (Tuner.restore) restarts that trial in a new run directory, runs the trial
    that never started, and rewrites the sweep's results. Two epochs a trial: the interrupt follows the
    first trial's config.yaml within 0.05 s, while its workers still start (test_signals' sweep test
    interrupts a one-epoch trial the same way)."""
    sweep = tmp_path / "sweep"

    def interrupt_once_a_trial_runs() -> None:
        deadline = time.time() + 120
        while not list(sweep.glob("trials/*/config.yaml")) and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=interrupt_once_a_trial_runs, daemon=True).start()
    first = runner.invoke(app, [
        "tune", "--model", "mlp", "--batch-sizes", "16,32", "--epochs", "2", "--max-concurrent-trials", "1",
        "--sweep-dir", str(sweep),
    ])  # fmt: skip
    assert "Traceback" not in first.output, first.output
    assert first.exit_code == 130 and f"go on with: distrain tune --resume {sweep}" in first.output, first.output
    before = pd.read_parquet(sweep / "results.parquet")
    assert len(before) == 1 and before["status"][0] != "completed", before
    interrupted = before["trial_id"][0]

    resumed = runner.invoke(app, ["tune", "--resume", str(sweep)])
    assert resumed.exit_code == 0, resumed.output
    after = pd.read_parquet(sweep / "results.parquet").set_index("trial_id")
    assert len(after) == 2 and set(after["batch_size"]) == {16, 32}, after
    assert (after["status"] == "completed").all()
    assert Path(after.loc[interrupted, "run_dir"]).name == f"{interrupted}-2"  # restarted, first record kept
    assert (sweep / "trials" / interrupted / "config.yaml").is_file()
    for run_dir in after["run_dir"]:
        assert (Path(run_dir) / "metrics.parquet").is_file()
    assert "best.yaml" in resumed.output
