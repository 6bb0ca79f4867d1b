"""Sandblaster across cut replicas (`--fsdp D`, strategies/sharded_sandblaster.py), end to end on real Ray
workers, shards and coordinator (tiny runs: a linear model on digits, whose weight and bias FSDP cuts in
two, so the shards' order is a real permutation of θ):

- L-BFGS at R = 1 x D = 2 equals plain Sandblaster with one worker, and gd at R = 2 x D = 2 (with
  --backup-tasks: copies of a portion from two replicas mix across the shards) equals plain Sandblaster
  with two workers, within 1e-5, iteration by iteration and at the end: a replica's D workers take each
  portion together, each half of its samples, and push the portion's summed gradient (FSDP's mean x D);
- the cut run's checkpoint is whole: the model and the L-BFGS state (float64 θ, the (s, y) history, the
  last gradient and step) in the model's order equal the plain run's, and a --resume at D = 1 from it
  ends where the plain run ends.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")

TOL = 1e-5
BASE = dict(strategy="sandblaster", model="linear", weight_decay=0.01, eval_every=0, seed=3, history=3)


def per_iteration(run_dir: Path):
    return steps_of(run_dir, sort_by=None).sort_values("step").groupby("step").first()


def whole_state(path: Path) -> list:
    """A checkpoint's Sandblaster state as one list of whole vectors (θ, s..., y..., last gradient, step)."""
    import torch

    shards = load_checkpoint(path)["strategy_state"]["state"]["shards"]
    joined = {k: [s[k] for s in shards] for k in shards[0]}
    out = [torch.cat(joined["theta"]), torch.cat(joined["prev_grad"]), torch.cat(joined["step"])]
    for key in ("s", "y"):
        out += [torch.cat([s[i] for s in joined[key]]) for i in range(len(joined[key][0]))]
    return out


def test_lbfgs_at_one_replica_of_two_equals_one_worker_and_its_checkpoint_is_whole(tmp_path):
    """L-BFGS at R = 1 x D = 2 for 2 iterations equals plain Sandblaster with one worker; its checkpoint
    equals the plain run's after iteration 2 (the model and the L-BFGS state, in the model's order); a
    --resume at D = 1 (a plain run on two PS shards, the state cut again) ends where the plain run ends."""
    from distrain.orchestrator.resume import resume_config

    kw = BASE | {"batch_optimizer": "lbfgs", "workers": 1, "tasks_per_pass": 4}
    plain = run_training(RunConfig(**kw, epochs=4, checkpoint_steps=2, run_dir=str(tmp_path / "plain")))
    cut = run_training(RunConfig(**kw, epochs=2, fsdp=2, run_dir=str(tmp_path / "cut")))
    assert cut.summary["status"] == "completed"
    a, b = per_iteration(plain.run_dir), per_iteration(cut.run_dir)
    np.testing.assert_allclose(b["loss"].to_numpy(), a["loss"].to_numpy()[:2], rtol=TOL)
    np.testing.assert_allclose(b["step_length"].to_numpy(), a["step_length"].to_numpy()[:2], rtol=TOL)
    rows = steps_of(cut.run_dir)
    assert sorted(set(zip(rows["replica"], rows["shard"], strict=True))) == [(0, 0), (0, 1)]
    ckpt = Path(cut.run_dir) / "checkpoints" / "final.pt"
    reference = Path(plain.run_dir) / "checkpoints" / "step-00000002.pt"
    theirs, ours = load_checkpoint(reference)["model"], load_checkpoint(ckpt)["model"]
    assert max((ours[k] - v).abs().max().item() for k, v in theirs.items()) <= TOL
    for x, y in zip(whole_state(ckpt), whole_state(reference), strict=True):
        assert (x - y).abs().max().item() <= TOL
    resumed = run_training(resume_config(cut.run_dir, {"epochs": 4, "fsdp": 1}), resume=True)
    assert resumed.summary["status"] == "completed"
    c = per_iteration(resumed.run_dir)
    np.testing.assert_allclose(c["loss"].to_numpy(), a["loss"].to_numpy(), rtol=TOL)
    assert (final_params(resumed.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL


def test_gd_at_two_replicas_of_two_with_backup_tasks_equals_two_workers(tmp_path):
    """gd at R = 2 x D = 2 with --backup-tasks (a portion's copies from two replicas mix across the shards)
    equals plain Sandblaster with two workers, iteration by iteration and at the end; each replica's two
    workers went through the same portions."""
    kw = BASE | {"batch_optimizer": "gd", "lr": 0.5, "epochs": 3, "workers": 2, "tasks_per_pass": 8}
    plain = run_training(RunConfig(**kw, run_dir=str(tmp_path / "plain")))
    cut = run_training(RunConfig(**kw, fsdp=2, backup_tasks=True, run_dir=str(tmp_path / "cut")))
    assert cut.summary["status"] == "completed"
    a, b = per_iteration(plain.run_dir), per_iteration(cut.run_dir)
    np.testing.assert_allclose(b["loss"].to_numpy(), a["loss"].to_numpy(), rtol=TOL)
    assert list(b["data_passes"]) == list(a["data_passes"]) == [1, 2, 3]
    assert (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL
    rows = steps_of(cut.run_dir)
    assert sorted(set(zip(rows["replica"], rows["shard"], strict=True))) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    per_replica = rows.groupby(["step", "replica"])["portions_done"].agg(["min", "max"])
    assert (per_replica["min"] == per_replica["max"]).all()
