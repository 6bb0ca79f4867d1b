"""Issue 28: backup workers (k-of-n BSP over the PS) across cut replicas, end to end in real Ray actors:
N + K replicas of D FSDP workers, worker (r, d) pushing its gradient chunk to PS shard d alone, and each
round the first N replicas whose D chunks have all arrived, one decision for all D shards
(strategies/ps_shard.py `RoundReferee`).

- a straggler on ONE worker of a replica makes that replica's chunk late at one shard only: its
  gradient is dropped at every shard in the rounds it is late (the `dropped` column, the same for the
  replica's D workers row by row; the shards' own record of each round's members is the same on both);
- exact: with the straggler's replica always late, the run equals plain k-of-n over the PS with the
  same samples counted (N x D plain workers on time, the K x D others late): the counted replicas'
  samples, whatever arrives where. Shards deciding apart would sometimes take the late replica's
  on-time chunk at shard 0 and the other replica's at shard 1, and the final θ would differ;
- without a straggler two equal replicas race at both shards every round, and every round still has one
  answer at both. (With the shards deciding apart, both tests failed on `rounds_shards_disagree`.)
"""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE = dict(
    model="mlp", epochs=1, seed=5, eval_every=0, optimizer="sgd", momentum=0.9, lr=0.05, strategy="bsp",
    transport="ps", batch_size=16,
)  # fmt: skip


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | {"run_dir": str(tmp_path / name)} | kw))



def test_a_replica_late_at_one_shard_is_dropped_at_every_shard_and_the_run_is_plain_k_of_n(tmp_path):
    """--workers 1 --backup-workers 1 --fsdp 2: N = 1 of 2 replicas x D = 2, worker 3 (replica 1, shard 1)
    computing 20x slower. Replica 1's chunk reaches shard 0 with replica 0's (they compute at once) and
    shard 1 late: every round closes on replica 0 at both shards, and replica 1 is dropped at both each
    time it pushes (its rows' `dropped`, the same for its 2 workers; the shards' members, round by round).
    Every round then applies replica 0's mean over its 2 x 16 samples (slices 0 and 1 of each step's 64),
    which plain k-of-n over the PS with 2 of 4 workers, workers 2 and 3 late, applies too: the final θ and
    the losses agree within 1e-5. Shards deciding apart would take replica 1's chunk at shard 0 whenever it
    came first there, and θ would differ."""
    common = dict(max_steps=12, segment_steps=6, lr_scaling="none", backup_workers=1)
    cut = run_training(cfg(tmp_path, "cut", workers=1, fsdp=2, straggler=["3:x20"], **common))
    summary = cut.summary
    assert summary["status"] == "completed" and summary["layout"]["worker_actors"] == 4
    # The shards' record: 12 rounds, each of one replica, the same one at both shards.
    assert summary["rounds_applied"] == 12 and summary["gradients_per_update"] == {"1": 12}
    assert summary["rounds_shards_disagree"] == 0
    rows = steps_of(cut.run_dir)
    assert rows.groupby("worker")[["replica", "shard"]].first().values.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    # The workers' record, row by row: a replica's 2 workers computed the same units on θ of one round,
    # and each unit's chunks were counted at both shards or dropped at both.
    per_replica = rows.groupby(["replica", "step"])
    assert (per_replica.size() == 2).all()
    assert (per_replica["dropped"].nunique() == 1).all() and (per_replica["read_version"].nunique() == 1).all()
    dropped = rows.groupby("replica")["dropped"]
    assert not dropped.get_group(0).astype(bool).any() and len(dropped.get_group(0)) == 24
    assert dropped.get_group(1).astype(bool).all() and (rows[rows["replica"] == 1]["staleness"] >= 1).all()
    assert summary["dropped_gradients"] == {"0": 0, "1": len(dropped.get_group(1)) // 2}
    assert summary["dropped_gradients"]["1"] >= 1

    late_workers = ["2:x20", "3:x20"]
    plain = run_training(cfg(tmp_path, "plain", workers=2, straggler=late_workers, **(common | {"backup_workers": 2})))
    reference = steps_of(plain.run_dir)
    assert plain.summary["gradients_per_update"] == {"2": 12}  # the same precondition: 2 and 3 always late
    late = reference.groupby("worker")["dropped"].apply(lambda d: d.astype(bool).all())
    assert late.tolist() == [False, False, True, True]
    assert (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item() <= 1e-5
    ours = rows[rows["replica"] == 0].groupby("step")["loss"].mean()
    theirs = reference[reference["worker"] <= 1].groupby("step")["loss"].mean()
    assert len(ours) == 12 and (ours - theirs).abs().max() <= 1e-5


def test_without_a_straggler_equal_replicas_race_and_every_round_has_one_answer(tmp_path):
    """N = 1 of 2 equal replicas x D = 2, no straggler: both replicas' chunks race at both shards each round,
    in orders of their own (the case where shards deciding apart split the model most often). Every round
    applies one replica at both shards, a replica's two rows agree on counted or dropped, the late one
    skips the rounds that closed without it, and every unit of the run is counted at most once."""
    run = run_training(cfg(tmp_path, "race", workers=1, fsdp=2, backup_workers=1, max_steps=12, segment_steps=6))
    summary = run.summary
    assert summary["status"] == "completed" and summary["rounds_applied"] == 12
    assert summary["gradients_per_update"] == {"1": 12} and summary["rounds_shards_disagree"] == 0
    rows = steps_of(run.run_dir)
    per_replica = rows.groupby(["replica", "step"])
    assert (per_replica.size() == 2).all()
    assert (per_replica["dropped"].nunique() == 1).all() and (per_replica["read_version"].nunique() == 1).all()
    applied = rows[~rows["dropped"].astype(bool)]
    # one replica's two chunks per round, and each of the 12 rounds applied a unit of its own step
    assert (applied.groupby("applied_version")["replica"].agg(["nunique", "size"]).values == [1, 2]).all()
    assert sorted(applied["applied_version"].unique()) == list(range(12))
    assert (applied["step"] == applied["applied_version"]).all()
    dropped = rows[rows["dropped"].astype(bool)]
    assert sum(summary["dropped_gradients"].values()) == len(dropped) // 2
