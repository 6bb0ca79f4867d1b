"""Sandblaster end to end, on real Ray workers, shards and coordinator (tiny runs: a linear model on digits).

- L-BFGS reaches the optimum of the L2-regularised logistic regression (computed here by scipy on the
  same training set) within 1e-4 relative;
- gd equals plain full-batch gradient descent in one process, step for step, with backup copies on and a
  worker killed (and replaced in place) part-way;
- a user's task through `--task` trains with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from distrain.strategies.ps_shard_group import shard_pool_kind
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")

LAMBDA = 0.01
WARM_SHARDS = shard_pool_kind(sandblaster=True, worker_actors=2)  # the warm pool's kind of the runs' shards



def per_iteration(run_dir: Path) -> pd.DataFrame:
    """Every worker's row of an iteration carries the same figures: one row per step."""
    return steps_of(run_dir, sort_by=None).sort_values("step").groupby("step").first()


def training_set() -> tuple[torch.Tensor, torch.Tensor]:
    from distrain.trainers.splits import task_splits
    from distrain.trainers.task import ClassificationTask

    # what the runs train on: the training set less the validation split (--val-fraction, default)
    train = task_splits(ClassificationTask(model="linear", dataset="digits"), RunConfig().val_fraction).train
    return train.get_batch(np.arange(len(train)))


def objective(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What Sandblaster minimises for `--model linear --weight-decay λ`: mean cross-entropy + (λ/2)‖θ‖²."""
    w, b = theta[: 64 * 10].view(10, 64), theta[64 * 10 :]
    return torch.nn.functional.cross_entropy(x.flatten(1) @ w.T + b, y) + 0.5 * LAMBDA * theta @ theta


def test_lbfgs_reaches_the_scipy_optimum_of_regularised_logistic_regression(tmp_path):
    from scipy.optimize import minimize

    x, y = (t.double() if t.is_floating_point() else t for t in training_set())

    def f_and_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        t = torch.tensor(theta, requires_grad=True)
        f = objective(t, x, y)
        f.backward()
        return float(f.detach()), t.grad.numpy()

    optimum = minimize(f_and_grad, np.zeros(650), jac=True, method="L-BFGS-B",
                       options={"gtol": 1e-10, "ftol": 1e-15, "maxiter": 3000}).fun  # fmt: skip
    cfg = RunConfig(
        strategy="sandblaster", model="linear", workers=2, ps_shards=2, weight_decay=LAMBDA, epochs=36,
        eval_every=36, run_dir=str(tmp_path / "lbfgs"),
    )  # fmt: skip
    result = run_training(cfg)
    it = per_iteration(result.run_dir)
    reached = it[it["loss"] <= optimum * (1 + 1e-4)]
    assert len(reached), f"L-BFGS ended at {it['loss'].iloc[-1]}, the optimum is {optimum}"
    # Armijo accepts t = 1 most of the time once the history is there: about two passes an iteration.
    assert reached["data_passes"].iloc[0] <= 2.5 * (reached.index[0] + 1)
    assert (it["loss"].diff().dropna() <= 1e-9).all()  # a line search never accepts an increase
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["outer_iterations"] == 36 and summary["sandblaster_iterations"] == 36
    assert summary["data_passes"] == summary["sandblaster_data_passes"] == it["data_passes"].iloc[-1]
    assert summary["sandblaster_loss_passes"] == summary["line_search_evals"]


def test_gd_is_plain_full_batch_gd_with_backup_copies_and_a_killed_worker(tmp_path):
    lr, epochs = 0.5, 5
    cfg = RunConfig(
        strategy="sandblaster", batch_optimizer="gd", lr=lr, model="linear", workers=3, ps_shards=2,
        tasks_per_pass=9, backup_tasks=True, weight_decay=LAMBDA, epochs=epochs, eval_every=epochs,
        chaos=["kill-worker@2:1"], run_dir=str(tmp_path / "gd"),
    )  # fmt: skip
    result = run_training(cfg)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["replacements"] == 1

    # The same steps in one process: the initial model is the run's (same seed), float64.
    from distrain.trainers.datasets import DATASETS
    from distrain.trainers.models import build_model

    model = build_model("linear", DATASETS.get("digits").info, cfg.seed)
    w, b = model[1].weight.detach(), model[1].bias.detach()
    theta = torch.cat([w.reshape(-1), b]).double()
    x, y = training_set()
    x = x.double()
    it = per_iteration(result.run_dir)
    for k in range(epochs):
        t = theta.clone().requires_grad_(True)
        f = objective(t, x, y)
        f.backward()
        assert it["loss"].iloc[k] == pytest.approx(float(f.detach()), rel=1e-5)
        theta = theta - lr * t.grad
    np.testing.assert_allclose(final_params(result.run_dir).numpy(), theta.numpy(), rtol=1e-4, atol=1e-6)
    assert list(it["data_passes"]) == list(range(1, epochs + 1))


def plain_gd(seed: int, lr: float, iterations: int) -> tuple[list[float], torch.Tensor]:
    """Full-batch gradient descent on the same objective in this process (float64): losses and θ."""
    from distrain.trainers.datasets import DATASETS
    from distrain.trainers.models import build_model

    model = build_model("linear", DATASETS.get("digits").info, seed)
    theta = torch.cat([model[1].weight.detach().reshape(-1), model[1].bias.detach()]).double()
    x, y = training_set()
    losses = []
    for _ in range(iterations):
        t = theta.clone().requires_grad_(True)
        f = objective(t, x.double(), y)
        f.backward()
        losses.append(float(f.detach()))
        theta = theta - lr * t.grad
    return losses, theta


def kill_a_worker_mid_pass(after_s: float, found: list[int]) -> None:
    """SIGKILL one worker process `after_s` seconds into its training segment: under Sandblaster a
    segment is a run of passes, each cut into portions, so the worker dies holding a portion."""
    import os
    import signal
    import time

    import psutil
    import ray

    # This session's Ray only (the raylet starts its workers): another Ray on the machine is not ours.
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["cmdline", "ppid"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.info["ppid"] == raylet and cmdline.startswith("ray::TrainWorker.run_segment"):
                time.sleep(after_s)
                os.kill(proc.pid, signal.SIGKILL)
                found.append(proc.pid)
                return
        time.sleep(0.05)


def test_a_worker_killed_in_the_middle_of_a_pass_has_its_portions_handed_out_again(tmp_path):
    """The pass completes without it: its outstanding portion is re-issued (nothing missed) and a push
    it made before dying counts once (nothing twice), so every iteration is still plain GD's."""
    import threading

    lr, epochs = 0.5, 6
    cfg = RunConfig(
        strategy="sandblaster", batch_optimizer="gd", lr=lr, model="linear", workers=2, ps_shards=1,
        tasks_per_pass=16, straggler=["0:0.04", "1:0.04"], weight_decay=LAMBDA, epochs=epochs,
        eval_every=epochs, run_dir=str(tmp_path / "mid-pass"),
    )  # fmt: skip
    killed: list[int] = []
    killer = threading.Thread(target=kill_a_worker_mid_pass, args=(1.0, killed), daemon=True)
    killer.start()
    result = run_training(cfg)
    killer.join(timeout=5)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert killed and summary["status"] == "completed" and summary["replacements"] == 1, summary.get("failures")
    # Without --backup-tasks a portion goes out again only because its worker died holding it.
    assert summary["sandblaster_portions_reissued"] >= 1, summary
    losses, theta = plain_gd(cfg.seed, lr, epochs)
    it = per_iteration(result.run_dir)
    np.testing.assert_allclose(it["loss"].to_numpy(), losses, rtol=1e-5)
    np.testing.assert_allclose(final_params(result.run_dir).numpy(), theta.numpy(), rtol=1e-4, atol=1e-6)


def test_resume_continues_exactly_with_the_lbfgs_history(tmp_path):
    """A run resumed from its iteration-3 checkpoint ends where the straight run ends: the checkpoint
    carries the shards' history pairs, the pending step and gradient, and the float64 θ.

    The first part runs on the straight run's shard processes, kept warm (orchestrator/warm_pool.py) and
    rebuilt: it starts with no history, as fresh shards do, so its iterations are the straight run's."""
    from distrain.orchestrator import warm_pool
    from distrain.orchestrator.resume import resume_config

    kw = dict(strategy="sandblaster", model="linear", workers=2, ps_shards=2, weight_decay=LAMBDA, history=3)
    straight = run_training(RunConfig(epochs=6, run_dir=str(tmp_path / "straight"), **kw))
    taken = warm_pool.taken(WARM_SHARDS)
    parts = run_training(RunConfig(epochs=3, run_dir=str(tmp_path / "parts"), **kw))
    assert warm_pool.taken(WARM_SHARDS) == taken + 2  # both shards were the straight run's processes
    first, whole = per_iteration(parts.run_dir), per_iteration(straight.run_dir)
    np.testing.assert_allclose(first["loss"].to_numpy(), whole["loss"].to_numpy()[:3], rtol=1e-7)
    np.testing.assert_allclose(first["step_length"].to_numpy(), whole["step_length"].to_numpy()[:3])
    resumed = run_training(resume_config(tmp_path / "parts", {"epochs": 6}), resume=True)
    assert (final_params(resumed.run_dir) - final_params(straight.run_dir)).abs().max().item() <= 1e-6
    a, b = per_iteration(straight.run_dir), per_iteration(resumed.run_dir)
    np.testing.assert_allclose(b["loss"].to_numpy(), a["loss"].to_numpy(), rtol=1e-7)
    np.testing.assert_allclose(b["step_length"].to_numpy(), a["step_length"].to_numpy())
    assert resumed.summary["data_passes"] == straight.summary["data_passes"]


def test_a_user_task_trains_with_sandblaster(tmp_path):
    task = str(Path(__file__).resolve().parents[2] / "examples" / "diabetes_regression.py") + ":Diabetes"
    cfg = RunConfig(strategy="sandblaster", task=task, workers=2, epochs=6, eval_every=6,
                    run_dir=str(tmp_path / "task"))  # fmt: skip
    result = run_training(cfg)
    it = per_iteration(result.run_dir)
    assert it["loss"].iloc[-1] < 0.7 * it["loss"].iloc[0]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_test_r2"] > 0.3
