"""Heterogeneous workers' static shares (--worker-weights) end to end: unequal batches, one update."""

from __future__ import annotations

import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        optimizer="sgd", momentum=0.9, lr=0.05, lr_scaling="none", epochs=1, max_steps=20, seed=7,
        workers=2, batch_size=32, segment_steps=10, eval_every=0, run_dir=str(tmp_path / name),
    )  # fmt: skip
    return RunConfig(**(base | kw))


def test_weighted_shares_equal_one_process_at_the_global_batch_on_both_transports(tmp_path):
    """--worker-weights 3,1 on 2 workers (b = 48 and 16 of B = 64) equals one worker at 64 over the same
    samples after 20 momentum-SGD steps, over the all-reduce and over the parameter server; each step row
    records the worker's share."""
    one = final_params(run_training(cfg(tmp_path, "one", workers=1, batch_size=64)).run_dir)
    for transport in ("collective", "ps"):
        run = run_training(cfg(tmp_path, transport, worker_weights="3,1", transport=transport))
        assert run.summary["steps_completed"] == 20
        assert (final_params(run.run_dir) - one).abs().max().item() <= 1e-5, transport
        steps = pd.read_parquet(run.run_dir / "metrics.parquet").query("kind == 'step'")
        assert steps.groupby("worker")["samples"].unique().map(list).to_dict() == {0: [48], 1: [16]}, transport
