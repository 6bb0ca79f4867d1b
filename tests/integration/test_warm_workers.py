"""Warm workers (orchestrator/warm_pool.py): the next run in a Ray session takes a completed run's
worker processes instead of starting new ones, and trains exactly as fresh workers would."""

from __future__ import annotations

import textwrap
import time

import numpy as np
import pandas as pd
import pytest
import ray

import distrain
from distrain.orchestrator import warm_pool

pytestmark = pytest.mark.usefixtures("ray_cluster")

# Dropout draws from torch's global RNG in the worker: a reused process must draw as a fresh one does
# (each worker seeds it from --seed and its rank when built).
TASK = textwrap.dedent(
    """
    import torch
    from torch.utils.data import TensorDataset

    import distrain

    SCALE = {scale}


    class Noisy(distrain.Task):
        def build_model(self):
            return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))

        def datasets(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, 4, generator=g)
            y = x.sum(1)
            return TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])

        def loss(self, model, batch):
            x, y = batch
            return SCALE * ((model(x).squeeze(-1) - y) ** 2).mean()
    """
)
FAILING = TASK + textwrap.dedent(
    """
    class Failing(Noisy):
        calls = 0

        def loss(self, model, batch):  # at a worker's third step (the driver's checks call it less)
            Failing.calls += 1
            if Failing.calls == 3:
                raise ValueError("the user's own bug")
            return super().loss(model, batch)
    """
)


def step_losses(run_dir) -> np.ndarray:
    df = pd.read_parquet(f"{run_dir}/metrics.parquet")
    return df[df.kind == "step"].sort_values(["epoch", "step", "worker"]).loss.to_numpy()


def fit(task: str, run_dir) -> distrain.FitResult:
    result = distrain.fit(task, workers=2, epochs=1, batch_size=32, run_dir=str(run_dir), progress=False)
    assert result.status == "completed"
    return result


def test_the_next_run_takes_the_warm_workers_and_trains_as_fresh_ones_would(tmp_path):
    task_file = tmp_path / "noisy.py"
    task_file.write_text(TASK.format(scale=1.0))
    warm_pool.release()  # none idle: the first run starts fresh workers
    taken = warm_pool.taken()
    fit(f"{task_file}:Noisy", tmp_path / "fresh")
    assert warm_pool.idle_count() == 2 and warm_pool.taken() == taken
    # Kept idle, they hold no CPU: the run's placement group held the CPUs and is gone.
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.time() < deadline, ray.available_resources()
        time.sleep(0.2)

    fit(f"{task_file}:Noisy", tmp_path / "warm")
    assert warm_pool.taken() == taken + 2  # both workers came from the pool
    np.testing.assert_array_equal(step_losses(tmp_path / "warm"), step_losses(tmp_path / "fresh"))

    task_file.write_text(TASK.format(scale=2.0))  # edited between runs: the warm workers read it again
    fit(f"{task_file}:Noisy", tmp_path / "edited")
    assert warm_pool.taken() == taken + 4
    first_step = slice(0, 2)  # step 0 of both workers: the same weights and dropout masks, twice the loss
    np.testing.assert_array_equal(
        step_losses(tmp_path / "edited")[first_step], 2 * step_losses(tmp_path / "fresh")[first_step]
    )


def test_a_failed_runs_workers_are_not_kept(tmp_path):
    task_file = tmp_path / "failing.py"
    task_file.write_text(FAILING.format(scale=1.0))
    warm_pool.release()
    with pytest.raises(ValueError, match="the user's own bug"):
        distrain.fit(f"{task_file}:Failing", workers=2, epochs=1, run_dir=str(tmp_path / "failed"), progress=False)
    assert (tmp_path / "failed" / "metrics.parquet").is_file()  # it failed in the workers, once started
    assert warm_pool.idle_count() == 0


def test_no_workers_are_kept_when_turned_off(tmp_path, monkeypatch):
    task_file = tmp_path / "noisy.py"
    task_file.write_text(TASK.format(scale=1.0))
    warm_pool.release()
    monkeypatch.setenv(warm_pool.WARM_ENV, "0")
    fit(f"{task_file}:Noisy", tmp_path / "off")
    assert warm_pool.idle_count() == 0
