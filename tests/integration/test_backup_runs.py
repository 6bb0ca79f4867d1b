"""Backup workers (k-of-n) and backup tasks end to end, on real Ray workers and shards, with a straggler."""

from __future__ import annotations

import json

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")



def test_k_of_n_applies_exactly_n_current_gradients_per_round_and_reaches_target(tmp_path):
    n, straggler = 2, 2
    cfg = RunConfig(
        strategy="bsp", transport="ps", workers=n, backup_workers=1, straggler=[f"{straggler}:0.04"],
        epochs=9, segment_steps=3, run_dir=str(tmp_path / "kofn"),  # short segments: some skip every unit
    )  # fmt: skip
    result = run_training(cfg)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    rows = steps_of(result.run_dir, sort_by=None)
    total_steps = summary["steps_completed"]

    # The shards' own record: every applied update averaged exactly N gradients, one per round.
    assert summary["rounds_applied"] == total_steps
    assert summary["gradients_per_update"] == {str(n): total_steps}
    # The workers' record agrees: per step, exactly N applied gradients, each tagged with that round.
    applied = rows[~rows["dropped"].astype(bool)]
    assert (applied.groupby("step").size() == n).all() and applied["step"].nunique() == total_steps
    assert (applied["applied_version"] == applied["step"]).all()
    assert (applied["read_version"] == applied["step"]).all()
    # Late gradients were dropped and counted, and the straggler's are among them.
    late = rows[rows["dropped"].astype(bool)]
    assert (late["staleness"] >= 1).all()
    dropped = summary["dropped_gradients"]
    assert sum(dropped.values()) == len(late) > 0 and dropped[str(straggler)] >= 1
    assert str(straggler) in summary["stragglers"]
    # The learning rate is scaled for N·B, not (N+b)·B.
    assert rows["lr"].max() == pytest.approx(cfg.lr * n * cfg.batch_size / cfg.base_batch_size)
    assert summary["final_test_accuracy"] >= 0.95


def test_backup_tasks_round_gradient_is_the_global_batch_mean_with_no_portion_counted_twice(tmp_path):
    common = dict(
        optimizer="sgd", momentum=0.0, lr=0.1, lr_scaling="none", epochs=1, max_steps=16, seed=3,
        segment_steps=8, eval_every=0,
    )  # fmt: skip
    # Reference: one process computing the mean gradient of the whole global batch (2 x 16) per step.
    single = run_training(RunConfig(workers=1, batch_size=32, run_dir=str(tmp_path / "one"), **common))
    backup = run_training(
        RunConfig(
            strategy="bsp",
            transport="ps",
            workers=2,
            batch_size=16,
            backup_tasks=True,
            portions=4,
            straggler=["1:0.03"],
            run_dir=str(tmp_path / "backup"),
            **common,
        )  # fmt: skip
    )
    assert (final_params(backup.run_dir) - final_params(single.run_dir)).abs().max().item() <= 1e-5

    rows = steps_of(backup.run_dir, sort_by=None)
    summary = json.loads((backup.run_dir / "summary.json").read_text())
    applied = rows[~rows["dropped"].astype(bool)]
    # Each round used each of its 4 portions exactly once...
    portions_used = applied.groupby("step")["slice"].apply(lambda s: tuple(sorted(s)))
    assert portions_used.map(lambda used: used == (0, 1, 2, 3)).all()
    assert applied["step"].nunique() == 16 and len(applied) == 16 * 4
    assert summary["gradients_per_update"] == {"4": 16}
    # ...although portions were re-executed: copies were issued and the losing copies dropped.
    assert summary["backup_copies_issued"] > 0
    assert rows["backup"].astype(bool).any()
    assert len(rows) - len(applied) == sum(summary["dropped_gradients"].values())
