"""A worker's own error (bad data, a bug) is deterministic: the run fails once with it, never retried.

Issue 13: a truncated MNIST file used to be found only inside the worker actors' constructors, taken
for a dead worker, and retried (forever with --max-failures -1). The driver's preflight finds such
files now (tests/unit/test_datasets_files.py); these tests switch that check off to reach the workers'
own handling, which still matters when the files differ between the driver's node and a worker's.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

from distrain.config import RunConfig
from distrain.orchestrator.recovery import classify
from distrain.orchestrator.run import run_training
from tests.unit.test_datasets_files import write_idx_images, write_idx_labels


def task_error(cause: Exception) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("TrainWorker.run_segment", "Traceback: ...", cause)


# ---------------------------------------------------------------- classify (no Ray started)
@pytest.mark.parametrize("cause", [ValueError("connection timeout in my loader"), IndexError("closed")])
def test_a_worker_error_that_mentions_a_network_word_is_not_a_lost_peer(cause):
    assert classify(task_error(cause), 0, "collective") is None


def test_a_gloo_runtime_error_is_a_lost_peer():
    lost = classify(task_error(RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")), 1, "collective")
    assert lost is not None and lost.kind == "worker"


RAY_FRAME = 'File "python/ray/includes/common.pxi", line 117, in ray._raylet.check_status'
USER_FRAME = 'File "/home/me/my_task.py", line 12, in load'


@pytest.mark.parametrize("transport", ["ps", "collective"])
def test_an_os_error_from_ray_s_own_client_is_a_lost_worker(transport):
    """Its node removed under it, a worker's ray.get raised `OSError: Broken pipe` from Ray's core (seen
    in CI under node churn): the worker is lost, not failing in the user's code."""
    error = ray.exceptions.RayTaskError(
        "TrainWorker.run_segment",
        f"Traceback (most recent call last):\n  {USER_FRAME}\n  {RAY_FRAME}\n",
        OSError("Broken pipe"),
    )
    lost = classify(error, 2, transport)
    assert lost is not None and lost.kind == "worker" and lost.target == 2


def test_an_os_error_from_the_user_s_code_is_still_the_user_s():
    error = ray.exceptions.RayTaskError(
        "TrainWorker.run_segment",
        f"Traceback (most recent call last):\n  {RAY_FRAME}\n  {USER_FRAME}\n",
        OSError("No such file"),
    )
    assert classify(error, 0, "ps") is None


def test_a_worker_whose_constructor_raised_is_not_a_lost_actor():
    died = ray.exceptions.ActorDiedError(task_error(ValueError("bad data")))
    assert died.actor_init_failed
    assert classify(died, 0, "collective") is None
    assert classify(ray.exceptions.ActorDiedError(), 0, "collective").kind == "worker"  # a real death still is


# ---------------------------------------------------------------- on a real Ray, the preflight switched off
def mnist(root, train_images: int, train_labels: int, cut: int = 0):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, n, m in (("train", train_images, train_labels), ("t10k", 40, 40)):
        write_idx_images(raw / f"{split}-images-idx3-ubyte", np.zeros((n, 28, 28), np.uint8))
        write_idx_labels(raw / f"{split}-labels-idx1-ubyte", np.zeros(m, np.uint8))
    if cut:
        path = raw / "train-images-idx3-ubyte"
        path.write_bytes(path.read_bytes()[:-cut])
    return root


def run(tmp_path, data_dir, **overrides):
    events = []
    config = RunConfig(
        model="mlp", dataset="mnist", data_dir=str(data_dir), epochs=1, max_steps=4, workers=2, batch_size=8,
        run_dir=str(tmp_path / "run"), **overrides,
    )  # fmt: skip
    return config, events, lambda: run_training(config, events.append)
