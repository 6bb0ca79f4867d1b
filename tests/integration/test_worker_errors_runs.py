"""A worker's own error (bad data, a bug) is deterministic: the run fails once with it, never retried.

Issue 13: a truncated MNIST file used to be found only inside the worker actors' constructors, taken
for a dead worker, and retried (forever with --max-failures -1). The driver's preflight finds such
files now (tests/unit/test_datasets_files.py); these tests switch that check off to reach the workers'
own handling, which still matters when the files differ between the driver's node and a worker's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.orchestrator import run_checks
from distrain.orchestrator.recovery import Failure
from distrain.orchestrator.run import run_training
from tests.unit.test_datasets_files import write_idx_images, write_idx_labels


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


@pytest.fixture
def no_preflight_data_check(monkeypatch):
    monkeypatch.setattr(run_checks, "check_dataset", lambda *args, **kwargs: None)  # preflight's check


def run(tmp_path, data_dir, **overrides):
    events = []
    config = RunConfig(
        model="mlp", dataset="mnist", data_dir=str(data_dir), epochs=1, max_steps=4, workers=2, batch_size=8,
        run_dir=str(tmp_path / "run"), **overrides,
    )  # fmt: skip
    return config, events, lambda: run_training(config, events.append)


def test_truncated_files_seen_only_by_the_workers_fail_once_with_the_one_line_error(
    ray_cluster, tmp_path, no_preflight_data_check
):
    data = mnist(tmp_path / "data", 200, 200, cut=1000)
    _, events, go = run(tmp_path, data, max_failures=-1)  # used to retry forever
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte is truncated") as info:
        go()
    assert "\n" not in str(info.value)
    assert not [e for e in events if isinstance(e, Failure)]  # never taken for a lost worker
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failures"] == 0
