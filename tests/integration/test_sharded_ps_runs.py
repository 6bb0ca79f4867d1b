"""Issue 28: the parameter-server strategies across cut replicas (strategies/sharded_ps.py), end to end
in real Ray actors over gloo: worker (r, d) runs its replica's FSDP step, pushes its gradient chunks to
PS shard d alone (shard d holds FSDP chunk d of every tensor) and pulls θ chunk d back.

- async with one replica cut over D = 2 workers equals one process at the batch D x B (momentum SGD, 20
  steps, within 1e-5): the issue's acceptance point;
- BSP over the PS with R = 2 replicas x D = 2 equals one process at the global batch R x D x B;
- the checkpoints are whole (the shards' θ and momentum put back in the model's order) and a run goes on
  from one: --resume at the same layout, and in one plain process, ends where one process does;
- --compress: each worker's chunk through the codec to its shard (lossless top-k equals one process);
- --tensor-parallel T instead of --fsdp (below): TP rank t pushes its part of every tensor the plan splits,
  and its rows of every tensor held whole (the mlp's last Linear, the rowwise layer's bias), to PS shard t
  alone, and the T ranks share the pulled whole tensors. async with one replica of T = 2 equals one process
  at the same batch, and its 10-step checkpoint is whole and resumes to one process's end; BSP over the PS
  at R = 2 x T = 2 equals one process at the global batch; ssp --staleness 1 at R = 2 x T = 2 keeps its
  bound and at R = 1 equals one process. A whole tensor pushed by every TP rank (twice per replica) or by
  none breaks each equality;
- --fsdp 2 --tensor-parallel 2: worker (d, t) pushes its piece to PS shard d x T + t; async with one replica
  equals one process at D x B after 10 steps, its checkpoint whole; the cnn's hybrid over the PS at T = 2
  equals one process at T x B;
- under --workers 1..2 with room for one replica (a range that never changes), bsp over the PS equals one
  process within 1e-5 with --fsdp 2 and with --tensor-parallel 2 (a replica's D x T workers their own
  group, a data-parallel rank's T workers dealt its slice together), and at T = 2 under --precision bf16
  the fixed-size run; a joiner's worker pulling the other TP rank's piece breaks it (max |Δ| 0.23); and
  under --compress topk:1 (each worker's chunk with its own residual) with --fsdp 2 it equals one process
  too (max |Δ| 4e-8; a push scaled by 0.9 under a range breaks it, max |Δ| 0.02);
- a replica killed under --workers 2..3 leaves whole, every slice once (bsp, async), and with
  --backup-workers 1 each round is the referee's first members - 1 complete replicas at both shards
  (shards deciding apart: 2 and 1 rounds disagreed in two runs).
"""

from __future__ import annotations

from pathlib import Path

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
    model="mlp", lr_scaling="none", epochs=1, max_steps=20, seed=3, segment_steps=10, eval_every=0,
    optimizer="sgd", momentum=0.9, lr=0.05,
)  # fmt: skip
TOL = 1e-5
MLP_PARAMS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | {"run_dir": str(tmp_path / name)} | kw))



@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One plain process at the global batch 64: its final parameters, step rows and run directory (with
    a checkpoint after step 10)."""
    run = run_training(cfg(tmp_path_factory.mktemp("one"), "one", workers=1, batch_size=64, checkpoint_steps=10))
    return final_params(run.run_dir), steps_of(run.run_dir), Path(run.run_dir)


def test_async_with_one_sharded_replica_equals_one_process(tmp_path, one_process):
    """--strategy async --transport ps --workers 1 --fsdp 2 --batch-size 32: two PS shards (the default
    --ps-shards is D), each worker pushes half the gradient to its own shard; the end is one process's at
    batch 64 within 1e-5, and each worker holds half the parameters."""
    run = run_training(cfg(tmp_path, "async", strategy="async", transport="ps", workers=1, fsdp=2, batch_size=32))
    assert run.summary["status"] == "completed"
    assert (final_params(run.run_dir) - one_process[0]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    assert (rows.groupby("step").size() == 2).all() and len(rows) == 40
    assert rows.groupby("worker")["shard"].first().tolist() == [0, 1] and (rows["replica"] == 0).all()
    mean_loss = rows.groupby("step")["loss"].mean().to_numpy()
    assert abs(mean_loss - one_process[1]["loss"].to_numpy()).max() <= TOL
    # One replica: every push is applied on the θ it was computed on, and each worker's clock is its steps.
    assert (rows["staleness"] == 0).all() and rows.groupby("worker")["clock"].max().tolist() == [20, 20]
    held = rows.groupby("worker")["mem_param_bytes"].max()
    assert held.sum() == MLP_PARAMS * 4 and (held <= 0.51 * MLP_PARAMS * 4).all()


def test_bsp_over_the_ps_with_two_replicas_of_two_shards_equals_one_process(tmp_path, one_process):
    """--strategy bsp --transport ps --workers 2 --fsdp 2 --batch-size 16: each PS shard's rounds close on
    the R = 2 replicas' chunks (not the 4 workers') and apply their mean: one process at batch 64."""
    run = run_training(cfg(tmp_path, "bsp", strategy="bsp", transport="ps", workers=2, fsdp=2, batch_size=16))
    assert run.summary["status"] == "completed" and run.summary["layout"]["worker_actors"] == 4
    assert (final_params(run.run_dir) - one_process[0]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    assert rows.groupby("worker")[["replica", "shard"]].first().values.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert rows.groupby("worker")["clock"].max().tolist() == [20] * 4  # 20 rounds, each of R = 2 pushes


def test_a_sharded_ps_checkpoint_is_whole_and_a_run_goes_on_from_it(tmp_path, one_process):
    """async R = 1 x D = 2 for 10 steps: final.pt holds the whole model and momentum in the model's order
    (un-permuted from the shards): both equal one process's checkpoint after step 10 within 1e-5, and
    `load_model` builds the task's model from it; it carries the shards' counters (one client: the
    replica). --resume to step 20 goes on from the uninterrupted loss to one process's end."""
    first = run_training(
        cfg(tmp_path, "a", strategy="async", transport="ps", workers=1, fsdp=2, batch_size=32, max_steps=10)
    )
    payload = load_checkpoint(Path(first.run_dir) / "checkpoints" / "final.pt")
    assert "sharded" not in payload and payload["ps"] == {"version": 10, "clocks": [10]}
    assert sum(t.numel() for t in payload["model"].values()) == MLP_PARAMS
    reference = load_checkpoint(one_process[2] / "checkpoints" / "step-00000010.pt")
    for key, value in reference["model"].items():
        assert (payload["model"][key] - value).abs().max().item() <= TOL, key
    momentum = payload["optimizer"]["vectors"]["momentum_buffer"]
    assert (momentum - reference["optimizer"]["vectors"]["momentum_buffer"]).abs().max().item() <= TOL
    model = load_model(first.run_dir)
    loaded = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    assert (loaded - final_params(first.run_dir)).abs().max().item() == 0
    same = run_training(resume_config(first.run_dir, {"max_steps": 20}), resume=True)
    assert same.summary["status"] == "completed"
    assert (final_params(same.run_dir) - one_process[0]).abs().max().item() <= TOL
    rows = steps_of(same.run_dir)
    after = rows[rows["step"] >= 10]
    assert len(after) == 20 and after.groupby("worker")["clock"].max().tolist() == [20, 20]
    expected = one_process[1].set_index("step")["loss"]  # the first resumed step: the uninterrupted loss
    assert abs(after[after["step"] == 10]["loss"].mean() - expected[10]) <= TOL


def test_ssp_with_two_sharded_replicas_keeps_its_bound(tmp_path, one_process):
    """--strategy ssp --staleness 1 --transport ps --workers 2 --fsdp 2: each PS shard bounds the R = 2
    replicas' clocks (its clients), so at every completed pull a worker's clock is at most 1 ahead of the
    slowest replica's; the run trains (its last loss well below its first)."""
    run = run_training(
        cfg(tmp_path, "ssp", strategy="ssp", staleness=1, transport="ps", workers=2, fsdp=2, batch_size=16)
    )
    assert run.summary["status"] == "completed"
    rows = steps_of(run.run_dir)
    assert len(rows) == 80 and rows.groupby("worker")["clock"].max().tolist() == [20] * 4
    assert ((rows["clock"] - rows["min_clock"]) <= 1).all() and (rows["staleness"] >= 0).all()
    losses = rows.groupby("step")["loss"].mean()
    assert losses.iloc[-3:].mean() < 0.5 * losses.iloc[:3].mean()


def test_compressed_pushes_across_a_sharded_replica_go_through_the_codec_and_lossless_equals_one_process(
    tmp_path, one_process
):
    """--strategy async --transport ps --workers 1 --fsdp 2 --compress topk:1: each worker's gradient chunk
    goes through the codec (its own residual) to its PS shard, which decodes it; top-k of every value is
    lossless, so the run ends at one process's parameters at batch 64 within 1e-5, and the rows count what
    the codec sent (values and their indices) against the float32 chunk it stood for."""
    run = run_training(
        cfg(tmp_path, "coded", strategy="async", transport="ps", workers=1, fsdp=2, batch_size=32, compress="topk:1")
    )
    assert run.summary["status"] == "completed"
    assert (final_params(run.run_dir) - one_process[0]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    # The pull is float32 (FSDP's bytes inside the replica, then the chunk): what the push stood for too.
    assert rows["bytes_uncompressed"].notna().all() and (rows["bytes_uncompressed"] == rows["bytes_received"]).all()
    assert (rows["bytes_sent"] > rows["bytes_uncompressed"]).all()  # top-k of all: the values and indices


@pytest.mark.parametrize(
    "layout, batch",
    [(dict(fsdp=2), 32), (dict(tensor_parallel=2), 64), (dict(tensor_parallel=2, precision="bf16"), 64)],
    ids=["fsdp2", "tp2", "tp2-bf16"],
)
def test_bsp_over_the_ps_under_a_range_that_never_changes_equals_one_process(tmp_path, one_process, layout, batch):
    """--workers 1..2 --transport ps with --fsdp 2 --batch-size 32, or --tensor-parallel 2 --batch-size 64,
    with room for one replica only (3 CPUs a worker: replica 1 stays pending, the membership never
    changes): the replica's D x T workers form their own group, the driver deals it replica units (worker
    (d, t): slice s x D + d of the step's MAX x D, a data-parallel rank's T workers sharing it), and the
    shards' rounds close on the member replica's pieces at the rate for 1 of MAX = 2 (--lr-scaling none: the
    same). A round is half a step, the next 64 samples: 10 steps are one process's 20 at batch 64 within
    1e-5. Under --precision bf16 (T = 2) the same run equals a fixed-size one (--workers 1, 20 steps at
    batch 64: the same computation in bf16) within 1e-5."""
    run = run_training(
        cfg(
            tmp_path, "range", strategy="bsp", transport="ps", workers="1..2", batch_size=batch, max_steps=10,
            cpus_per_worker=3.0, **layout,
        )
    )  # fmt: skip
    s = run.summary
    assert s["status"] == "completed" and s["failures"] == 0
    assert (s["membership"]["joins"], s["membership"]["leaves"], s["membership"]["final_members"]) == (0, 0, 2)
    expected = one_process[0]
    if "precision" in layout:
        fixed = run_training(cfg(tmp_path, "fixed", strategy="bsp", transport="ps", workers=1, batch_size=batch,
                                 **layout))  # fmt: skip
        assert fixed.summary["status"] == "completed"
        expected = final_params(fixed.run_dir)
        assert (expected - one_process[0]).abs().max().item() > TOL  # bf16 is not one fp32 process
    assert (final_params(run.run_dir) - expected).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    ranks = 2 // layout.get("tensor_parallel", 1)  # D: the data-parallel ranks of a replica, each a slice
    units = rows.groupby(["epoch", "step", "slice"]).size()
    assert len(units) == 10 * 2 * ranks and (units == 2 // ranks).all()  # a rank's T workers each have its row
    assert rows.groupby("worker")["clock"].max().tolist() == [20, 20]


def test_compressed_pushes_across_cut_replicas_under_a_range_that_never_changes_equal_one_process(
    tmp_path, one_process
):
    """--workers 1..2 --transport ps --fsdp 2 --compress topk:1 with room for one replica (as above): each
    worker's chunk goes through the codec with its own residual (a joiner's would start at zero, a leaver's
    go with it: nothing agreed across replicas), and top-k of every value loses nothing, so the run ends at
    one process's parameters within 1e-5, its pushes the values and their indices."""
    run = run_training(
        cfg(
            tmp_path, "coded-range", strategy="bsp", transport="ps", workers="1..2", fsdp=2, batch_size=32,
            max_steps=10, cpus_per_worker=3.0, compress="topk:1",
        )
    )  # fmt: skip
    s = run.summary
    assert s["status"] == "completed" and s["failures"] == 0 and s["compress"] == "topk:1"
    assert (s["membership"]["joins"], s["membership"]["leaves"], s["membership"]["final_members"]) == (0, 0, 2)
    assert (final_params(run.run_dir) - one_process[0]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    assert rows["bytes_uncompressed"].notna().all() and (rows["bytes_sent"] > rows["bytes_uncompressed"]).all()


@pytest.mark.parametrize("strategy, backups", [("bsp", 0), ("async", 0), ("bsp", 1)], ids=["bsp", "async", "k-of-n"])
def test_a_replica_killed_under_a_range_leaves_whole_and_the_run_goes_on_with_every_slice_once(
    tmp_path, strategy, backups
):
    """--workers 2..3 --fsdp 2 --transport ps --chaos kill-worker@4:3: rank 3 is worker 1 of replica 1; its
    sibling (rank 2, whose FSDP collectives would wait for it) is stopped with it, or, when its collective
    fails first (gloo: the connection closed), returns its segment broken and the driver finds rank 3 gone
    (whichever the driver reads first: the same leaves, in the same order), the replica leaves whole
    (a shrink to MIN, not a failure: no restart), the units of its segments not wholly back go to the other
    replicas, and every (epoch, step, slice) of the 6 a step has exactly one row.

    k-of-n (--backup-workers 1, MIN 2 > K), worker 5 (replica 2's chunk for shard 1) 20x slower: each round
    applies the first members - 1 member replicas whose both chunks arrived, one answer for both shards (the
    referee on shard 0, deciding from its members as replica 1 leaves and its slot is filled again): a
    replica's two rows agree on counted or dropped and on the round, no round counts more than 3 - 1
    replicas, some gradients are dropped, none skips a unit, and the shards' record of every round's
    members is the same (`rounds_shards_disagree`). Shards deciding apart (each on its own arrivals:
    replica 2's chunk is on time at shard 0 and late at shard 1) fail it."""
    run = run_training(
        cfg(
            tmp_path, f"{strategy}{backups}", strategy=strategy, transport="ps", workers="2..3", fsdp=2,
            batch_size=16, max_steps=8, segment_steps=2, chaos=["kill-worker@4:3"], hang_timeout_s=20.0,
            collective_timeout_s=60.0, backup_workers=backups, straggler=["5:x20"] if backups else [],
        )
    )  # fmt: skip
    s = run.summary
    assert s["status"] == "completed" and s["failures"] == 0 and [c["fired_step"] for c in s["chaos"]] == [4]
    changes = [(e["change"], e["rank"], e["cause"]) for e in s["membership"]["events"]]
    assert all(cause != "restart" for _, _, cause in changes)
    left = [(rank, cause) for change, rank, cause in changes if change == "leave"]
    assert left == [(3, "worker lost"), (2, "replica of 3 left (worker lost)")]
    rows = steps_of(run.run_dir)
    units = rows.groupby(["epoch", "step", "slice"]).size()
    assert len(units) == 8 * 6 and (units == 1).all()
    assert rows.groupby("worker")[["replica", "shard"]].first().values.tolist()[:2] == [[0, 0], [0, 1]]
    if strategy == "bsp":  # the shards' record of every round's members, the same at both (the referee's)
        assert s["rounds_shards_disagree"] == 0 and s["rounds_applied"] == rows["read_version"].max() + 1
    if backups:
        per_replica = rows.groupby(["replica", "read_version"])
        assert (per_replica.size() == 2).all() and (per_replica["dropped"].nunique() == 1).all()
        counted = rows[~rows["dropped"].astype(bool)]
        per_round = counted.groupby("applied_version")["replica"].agg(["nunique", "size"])
        assert (per_round["size"] == 2 * per_round["nunique"]).all() and per_round["nunique"].max() <= 3 - backups
        sizes = {int(k): v for k, v in s["gradients_per_update"].items()}
        assert max(sizes) == 3 - backups and 1 in sizes  # 3 members, and 2 (after the leave, or idle at the end)
        assert sum(k * v for k, v in sizes.items()) >= len(counted) // 2  # (a lost segment's applied, row gone)
        assert rows["dropped"].astype(bool).any() and sum(s["dropped_gradients"].values()) >= 1


# The mlp under its plan: "1" colwise (weight and bias split by rows), "3" rowwise (weight split by columns,
# its bias whole), "5" not in the plan (whole): what one TP rank of T = 2 holds.
TP_HALF = (64 * 256 + 256) // 2 + 256 * 256 // 2 + 256 + 256 * 10 + 10


def test_async_with_one_tensor_parallel_replica_equals_one_process_and_its_checkpoint_resumes(tmp_path, one_process):
    """--strategy async --transport ps --workers 1 --tensor-parallel 2 --batch-size 64, 10 steps then
    --resume to 20: two PS shards (the default --ps-shards is T); the 10-step checkpoint holds the whole
    model and momentum in the model's order, equal to one process's after step 10 within 1e-5, and
    `load_model` builds the model from it; the resumed run ends at one process's parameters."""
    first = run_training(
        cfg(tmp_path, "a", strategy="async", transport="ps", workers=1, tensor_parallel=2, batch_size=64, max_steps=10)
    )
    assert first.summary["status"] == "completed"
    payload = load_checkpoint(Path(first.run_dir) / "checkpoints" / "final.pt")
    assert "sharded" not in payload and payload["ps"] == {"version": 10, "clocks": [10]}
    reference = load_checkpoint(one_process[2] / "checkpoints" / "step-00000010.pt")
    assert list(payload["model"]) == list(reference["model"])
    for key, value in reference["model"].items():
        assert payload["model"][key].shape == value.shape, key
        assert (payload["model"][key] - value).abs().max().item() <= TOL, key
    momentum = payload["optimizer"]["vectors"]["momentum_buffer"]
    assert momentum.numel() == MLP_PARAMS
    assert (momentum - reference["optimizer"]["vectors"]["momentum_buffer"]).abs().max().item() <= TOL
    model = load_model(first.run_dir)
    loaded = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    assert (loaded - final_params(first.run_dir)).abs().max().item() == 0
    rows = steps_of(first.run_dir)
    assert rows.groupby("worker")["tp"].first().tolist() == [0, 1] and (rows["replica"] == 0).all()
    assert (rows["staleness"] == 0).all()  # one replica: each push applied on the θ it was computed on
    assert rows.groupby("worker")["mem_param_bytes"].max().tolist() == [TP_HALF * 4] * 2
    same = run_training(resume_config(first.run_dir, {"max_steps": 20}), resume=True)
    assert same.summary["status"] == "completed"
    assert (final_params(same.run_dir) - one_process[0]).abs().max().item() <= TOL
    after = steps_of(same.run_dir)
    after = after[after["step"] >= 10]
    assert len(after) == 20 and after.groupby("worker")["clock"].max().tolist() == [20, 20]
    losses = after.groupby("step")["loss"]
    assert (losses.max() - losses.min()).max() <= TOL  # the T workers computed one loss on one batch
    expected = one_process[1].set_index("step")["loss"]
    assert abs(losses.mean() - expected[losses.mean().index]).max() <= TOL


def test_bsp_over_the_ps_with_two_tensor_parallel_replicas_equals_one_process(tmp_path, one_process):
    """--strategy bsp --transport ps --workers 2 --tensor-parallel 2 --batch-size 32: each PS shard's
    rounds close on the R = 2 replicas' parts and apply their mean: one process at batch 64."""
    run = run_training(
        cfg(tmp_path, "bsp", strategy="bsp", transport="ps", workers=2, tensor_parallel=2, batch_size=32)
    )
    assert run.summary["status"] == "completed" and run.summary["layout"]["worker_actors"] == 4
    assert (final_params(run.run_dir) - one_process[0]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    assert rows.groupby("worker")[["replica", "tp"]].first().values.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert rows.groupby("worker")["clock"].max().tolist() == [20] * 4  # 20 rounds, each of R = 2 pushes


def test_ssp_across_tensor_parallel_replicas_keeps_its_bound_and_one_replica_equals_one_process(
    tmp_path, one_process
):
    """--strategy ssp --staleness 1 --transport ps --tensor-parallel 2: with --workers 2, 12 steps, each PS
    shard bounds the R = 2 replicas' clocks, so at every pull a worker is at most 1 ahead of the slowest
    replica, and the run trains; with --workers 1, 10 steps (one client: it never waits, each push at
    lr), θ equals one process's after step 10 within 1e-5."""
    run = run_training(
        cfg(tmp_path, "ssp", strategy="ssp", staleness=1, transport="ps", workers=2, tensor_parallel=2,
            batch_size=16, max_steps=12)
    )  # fmt: skip
    assert run.summary["status"] == "completed"
    rows = steps_of(run.run_dir)
    assert len(rows) == 48 and rows.groupby("worker")["clock"].max().tolist() == [12] * 4
    assert ((rows["clock"] - rows["min_clock"]) <= 1).all() and (rows["staleness"] >= 0).all()
    losses = rows.groupby("step")["loss"].mean()
    assert losses.iloc[-3:].mean() < 0.9 * losses.iloc[:3].mean()
    one = run_training(
        cfg(tmp_path, "ssp1", strategy="ssp", staleness=1, transport="ps", workers=1, tensor_parallel=2,
            batch_size=64, max_steps=10)
    )  # fmt: skip
    reference = load_checkpoint(one_process[2] / "checkpoints" / "step-00000010.pt")["model"]
    whole = torch.cat([t.reshape(-1).double() for t in reference.values()])
    assert (final_params(one.run_dir) - whole).abs().max().item() <= TOL


# --fsdp 2 --tensor-parallel 2 (the mlp's plan): what worker (d, t) holds, FSDP's chunk d of TP rank t's part of
# a split tensor ("1"'s weight and bias, "3"'s weight), FSDP's chunk d of a whole one ("3"'s bias; "5": 10 rows,
# 5 a chunk).
DXT_QUARTER = (64 * 256 + 256) // 4 + 256 * 256 // 4 + 256 // 2 + 5 * 256 + 5


def test_async_with_one_replica_of_fsdp_and_tensor_parallel_equals_one_process_and_its_checkpoint_is_whole(
    tmp_path, one_process
):
    """--strategy async --transport ps --workers 1 --fsdp 2 --tensor-parallel 2 --batch-size 32, 10 steps: four
    PS shards (the default --ps-shards is D x T), worker (d, t) pushing its piece, FSDP's chunk d of TP rank
    t's part of a split tensor and its rows of FSDP's chunk d of a whole one, to shard d x T + t alone. Each
    step's loss is one process's at batch 64, and the final checkpoint holds the whole model and momentum in
    the model's order, equal to one process's after step 10 within 1e-5. A piece pushed twice (a whole
    tensor's rows by both TP ranks) or to the wrong shard (a split tensor's two cuts taken in the other
    order) breaks these equalities."""
    run = run_training(
        cfg(tmp_path, "dxt", strategy="async", transport="ps", workers=1, fsdp=2, tensor_parallel=2, batch_size=32,
            max_steps=10)
    )  # fmt: skip
    assert run.summary["status"] == "completed" and run.summary["layout"]["worker_actors"] == 4
    payload = load_checkpoint(Path(run.run_dir) / "checkpoints" / "final.pt")
    assert "sharded" not in payload and payload["ps"] == {"version": 10, "clocks": [10]}
    reference = load_checkpoint(one_process[2] / "checkpoints" / "step-00000010.pt")
    assert list(payload["model"]) == list(reference["model"])
    for key, value in reference["model"].items():
        assert (payload["model"][key] - value).abs().max().item() <= TOL, key
    momentum = payload["optimizer"]["vectors"]["momentum_buffer"]
    assert (momentum - reference["optimizer"]["vectors"]["momentum_buffer"]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    assert rows.groupby("worker")[["shard", "tp"]].first().values.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert (rows["staleness"] == 0).all() and rows.groupby("worker")["clock"].max().tolist() == [10] * 4
    assert rows.groupby("worker")["mem_param_bytes"].max().tolist() == [DXT_QUARTER * 4] * 4
    losses = rows.groupby("step")["loss"].mean().to_numpy()
    assert abs(losses - one_process[1]["loss"].to_numpy()[:10]).max() <= TOL


def test_the_cnn_hybrid_over_the_ps_equals_one_process_at_t_times_the_batch(tmp_path):
    """--model cnn --strategy async --transport ps --workers 1 --tensor-parallel 2 --batch-size 8, 8 steps: the
    hybrid's two TP workers each take their own 8 samples (slice = rank), `HybridGradients` makes every
    gradient the mean over all 16 (the convolutions' summed over the two), and each pushes its part of the
    split classifier and its rows of the tensors held whole (the convolutions, the last Linear's bias) to
    its PS shard: one process at batch 16 within 1e-5. A whole tensor's rows pushed by both workers breaks it."""
    hybrid = dict(model="cnn", max_steps=8)
    one = run_training(cfg(tmp_path, "one", workers=1, batch_size=16, **hybrid))
    run = run_training(
        cfg(tmp_path, "hybrid", strategy="async", transport="ps", workers=1, tensor_parallel=2, batch_size=8,
            **hybrid)
    )  # fmt: skip
    assert run.summary["status"] == "completed" and run.summary["global_batch_size"] == 16
    assert (final_params(run.run_dir) - final_params(one.run_dir)).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    assert rows.groupby("worker")[["tp", "slice"]].first().values.tolist() == [[0, 0], [1, 1]]
    assert (rows["samples"] == 8).all() and (rows["staleness"] == 0).all()
