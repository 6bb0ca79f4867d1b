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

And backup tasks (--backup-tasks, strategies/sharded_backup_tasks.py) across cut replicas: a replica's D
workers take each chunk of portions together, rank d its 1/D of the chunk's samples, each pushing its
piece to its own shard; the shards keep the first copy of each portion apiece. R = 1 x D = 2 and R = 2 x
D = 2 (a straggler in replica 1, copies issued) both end where one process at the same global batch does.
"""

from __future__ import annotations

import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run import run_training
from distrain.orchestrator.trained_model import load_model
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


# Backup tasks across cut replicas: 6 rounds of 4 portions of the global batch 32, against one process.
TASKS = dict(max_steps=6, segment_steps=3, lr_scaling="none", backup_tasks=True, portions=4)
MLP_PARAMS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One plain process at the global batch 32 for 6 steps (a checkpoint after step 3): its run directory."""
    common = dict(max_steps=6, segment_steps=3, lr_scaling="none", strategy="bsp", transport="collective")
    run_dir = tmp_path_factory.mktemp("one")
    return run_training(cfg(run_dir, "one", workers=1, batch_size=32, checkpoint_steps=3, **common)).run_dir


def test_backup_tasks_on_one_replica_of_two_shards_equal_one_process_and_resume(tmp_path, one_process):
    """--backup-tasks --portions 4 --workers 1 --fsdp 2 --batch-size 16 for 3 steps, then --resume to 6: the
    replica's 2 workers take each chunk together, each computing half its samples (FSDP's mean over them:
    the chunk's mean) and pushing its half of the gradient to its own shard. The 3-step final.pt is whole
    (the model's order, loadable as the task's model) and its θ and momentum equal one process's at batch
    32 after 3 steps within 1e-5; the resumed run (the scheduler's rounds going on from the shards'
    version) ends at one process's 6-step θ. Each round's 4 portions were counted once at each shard,
    and a portion's rows name slice portion x 2 + d."""
    first = run_training(cfg(tmp_path, "cut", workers=1, fsdp=2, batch_size=16, **(TASKS | {"max_steps": 3})))
    assert first.summary["status"] == "completed" and first.summary["layout"]["worker_actors"] == 2
    payload = load_checkpoint(first.run_dir / "checkpoints" / "final.pt")
    reference = load_checkpoint(one_process / "checkpoints" / "step-00000003.pt")
    assert "sharded" not in payload and payload["ps"] == {"version": 3, "clocks": [0]}
    assert sum(t.numel() for t in payload["model"].values()) == MLP_PARAMS
    for key, value in reference["model"].items():
        assert (payload["model"][key] - value).abs().max().item() <= 1e-5, key
    momentum = payload["optimizer"]["vectors"]["momentum_buffer"]
    assert (momentum - reference["optimizer"]["vectors"]["momentum_buffer"]).abs().max().item() <= 1e-5
    loaded = torch.cat([p.detach().reshape(-1).double() for p in load_model(first.run_dir).parameters()])
    assert (loaded - final_params(first.run_dir)).abs().max().item() == 0
    run = run_training(resume_config(first.run_dir, {"max_steps": 6}), resume=True)
    assert run.summary["status"] == "completed"
    assert (final_params(run.run_dir) - final_params(one_process)).abs().max().item() <= 1e-5
    rows = steps_of(run.run_dir)
    assert not rows["dropped"].astype(bool).any() and len(rows) == 6 * 4 * 2
    slices = rows.groupby(["step", "shard"])["slice"].apply(sorted)
    assert len(slices) == 12 and all(s == [2 * p + d for p in range(4)] for (_, d), s in slices.items())
    assert run.summary["gradients_per_update"] == {"4": 3}  # (the resumed attempt's shards: rounds 4 to 6)


def test_backup_tasks_across_two_replicas_with_a_straggler_equal_one_process(tmp_path, one_process):
    """--workers 2 --fsdp 2 --batch-size 8, worker 3 (replica 1, shard 1) 20x slower: replica 1 is slow as a
    whole (FSDP's collectives wait for worker 3), replica 0 takes copies of its chunks, and each shard keeps
    the first copy of each portion on its own. The rounds still apply the mean over the global batch 32:
    one process's final θ within 1e-5. At each shard every round counted each portion exactly once, and
    a replica's two workers computed every chunk on θ of one round."""
    run = run_training(cfg(tmp_path, "cut2", workers=2, fsdp=2, batch_size=8, straggler=["3:x20"], **TASKS))
    summary = run.summary
    assert summary["status"] == "completed" and summary["layout"]["worker_actors"] == 4
    assert (final_params(run.run_dir) - final_params(one_process)).abs().max().item() <= 1e-5
    rows = steps_of(run.run_dir)
    applied = rows[~rows["dropped"].astype(bool)]
    used = applied.groupby(["step", "shard"])["slice"].apply(lambda s: sorted(s // 2))
    assert len(used) == 12 and all(u == [0, 1, 2, 3] for u in used)
    assert (rows["slice"] % 2 == rows["shard"]).all()
    mates = rows.groupby(["replica", "step", rows["slice"] // 2, "backup"])
    assert (mates.size() % 2 == 0).all() and (mates["read_version"].nunique() == 1).all()
    assert summary["backup_copies_issued"] > 0 and rows["backup"].astype(bool).any()
