"""Elastic BSP across tensor-parallel replicas (issue 28): `--tensor-parallel 2 --workers 2..3` on the shared
local Ray. A range whose membership never changes equals the fixed run of its members (the cnn's hybrid plan,
each tensor-parallel worker on its own unit); under fp16 one worker of a replica killed mid-run, its mate
alive, takes its replica out whole without a restart (the live mate's process is ended as soon as it is back
from the block, so the other replicas' collectives with it fail at once, not after --collective-timeout-s)
and the replica joins
again from a live replica's pieces and loss scale, the two tensor-parallel workers of the mlp taking each
unit together, overflows skipped by every member alike and every (epoch, step, slice) trained exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

import distrain
from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.run import run_training
from tests.helpers import LoudDigits, PaceUntilRejoined, final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
SMALL = dict(
    strategy="bsp", tensor_parallel=2, batch_size=16, lr_scaling="none", seed=3, epochs=1, segment_steps=2,
    eval_every=0, optimizer="sgd", momentum=0.9, lr=0.05,
)  # fmt: skip


def test_a_range_that_never_changes_equals_the_fixed_run_of_its_members(tmp_path):
    """2 CPUs a worker on the fixture's 8: MIN = 2 replicas of T = 2 are placed, the third never is. The
    range's step is MAX x T slices (the cnn's hybrid plan: each tensor-parallel worker on its own unit),
    dealt 4 a round in order, so its first 24 units are the fixed run's first 6 steps, sample for sample,
    at the same rate (--lr-scaling none)."""
    model = "cnn"
    elastic = run_training(
        RunConfig(model=model, workers="2..3", cpus_per_worker=2.0, max_steps=4, run_dir=str(tmp_path / "e"), **SMALL)
    ).summary
    fixed = run_training(RunConfig(model=model, workers=2, max_steps=6, run_dir=str(tmp_path / "f"), **SMALL)).summary
    assert elastic["status"] == fixed["status"] == "completed"
    m = elastic["membership"]
    assert [len(r["members"]) for r in m["reforms"]] == [4] and m["final_members"] == 4, m
    rows = steps_of(tmp_path / "e")
    assert set(rows["members"]) == {4} and len(rows) == 4 * 6  # 6 rounds, a row per worker
    gap = (final_params(tmp_path / "e") - final_params(tmp_path / "f")).abs().max().item()
    assert gap < 1e-5, gap


def test_fp16_tensor_parallel_worker_killed_alone_takes_its_replica_out_which_rejoins_with_the_live_scale(tmp_path):
    """Rank 5 (worker t = 1 of replica 2) killed at step 6, rank 4 alive: rank 4's collectives with it fail at
    once (a closed connection) and rank 4 comes back; the driver then ends rank 4's process, so the other
    replicas' workers, waiting on rank 4 in the mesh's groups, fail at once too, seconds after the kill and not
    after --collective-timeout-s 120. Blocks run faster than a replica is built: until replica 2
    (ranks 4, 5) has trained, the driver waits 8 s between blocks (one not placed at the start joins later), and
    after the kill 3 s until it is back, so its replacement joins before the end."""
    s = distrain.fit(
        LoudDigits, workers="2..3", precision="fp16", max_steps=16, chaos=["kill-worker@6:5"],
        collective_timeout_s=120.0, hang_timeout_s=60.0, run_dir=str(tmp_path / "r"), progress=False,
        callbacks=[PaceUntilRejoined([4], at=6, pause_s=3.0, before_s=8.0)],
        **SMALL | {"lr": 5e-6, "segment_steps": 1},
    ).summary  # fmt: skip
    assert s["status"] == "completed" and s["failures"] == 0, s.get("failure_events")
    assert [c["fired_step"] for c in s["chaos"]] == [6], s["chaos"]
    m = s["membership"]
    # (on a busy machine the third replica may be placed after the first two started: a join before step 1)
    changes = [(e["change"], e["rank"], e["cause"]) for e in m["events"] if e["change"] == "leave" or e["step"] > 0]
    # Rank 5 lost alone: replica 2 leaves whole (its live mate taken out with it), without a restart and
    # with nobody declared hung, and the slot's new group joins whole.
    assert sorted(changes[:2]) == [("leave", 4, "replica of 5 left (worker lost)"), ("leave", 5, "worker lost")]
    assert {("join", 4), ("join", 5)} <= {(change, rank) for change, rank, _ in changes[2:]}
    reforms = m["reforms"]
    for reform in reforms:  # worker (d, t) = rank % 2 holds the same piece on every replica after each re-form,
        for place in (0, 1):  # and every member the source's loss scale
            assert len({reform["after"][str(r)] for r in reform["members"] if r % 2 == place}) == 1, reform
        live = reform["scale"][str(reform["source"])][0]
        assert {after for _, after in reform["scale"].values()} == {live}, reform
    grow = next(r for r in reforms if r["cause"] == "resize" and 4 in r["members"] and 4 not in r["survivors"])
    for joiner in (4, 5):  # the joiners took a live replica's pieces and scale (not their own fresh start)
        live = {grow["before"][str(r)] for r in grow["survivors"] if r % 2 == joiner % 2}
        assert live == {grow["after"][str(joiner)]} and grow["before"][str(joiner)] not in live, grow
        fresh, taken = grow["scale"][str(joiner)]
        assert fresh == 2.0**16 and taken < fresh, grow
    rows = steps_of(tmp_path / "r")
    # The leave is booked at the end of the block the kill broke: seconds after the last step before the kill
    # (the pacing callback waits 3 s there), where waiting out the collective timeout would take 120 s.
    leave = next(e for e in m["events"] if e["change"] == "leave" and e["rank"] == 5)
    broke_after = leave["wall_time"] - rows.loc[rows["step"] < 6, "wall_time"].max()
    assert 0 < broke_after < 60, broke_after
    # The loud loss overflows the starting scale. Before the kill a round is one step of the 3 replicas' 3
    # units (6 rows; 4 while a late third replica was not yet in): each step was skipped by every member or
    # by none, the first ones all skipped.
    skipped = rows["nonfinite"].fillna(False).astype(bool)
    assert rows.loc[skipped, "overflow"].eq(True).all()
    early = rows[rows["step"] < 6].assign(skipped=skipped).groupby("step")["skipped"].agg(["all", "any", "size"])
    assert early["size"].isin([4, 6]).all() and (early["size"] == 6).any(), early
    assert (early["all"] == early["any"]).all(), early
    overflows = int(early["all"].sum())
    assert overflows >= 3 and early["all"].tolist()[:overflows] == [True] * overflows, early
    # Over the whole run, re-forms included, worker (d, t)'s pieces before each of its steps are among live
    # replica 0's (a member that skipped a step the others applied would hold pieces of its own from then on).
    sums = rows.groupby("worker")["train_param_sum"].apply(set)
    assert not skipped.all() and len(sums[0]) > 1  # the later steps trained
    for worker in range(2, 6):
        assert sums[worker] <= sums[worker % 2], worker
    final = load_checkpoint(Path(tmp_path / "r") / "checkpoints" / "final.pt")
    assert final["scaler"]["overflows"] >= overflows and final["scaler"]["scale"] <= 2.0**16 / 2**overflows
    # Every (epoch, step, slice) of MAX = 3 slices a step trained exactly once, by both tensor-parallel
    # workers of a replica together: a row of each (tp = 0 and 1), or listed without a row in the leave of
    # a killed worker (the lost rank 5's units applied in rounds that stand; its live mate's rows are there).
    done = list(zip(rows["epoch"], rows["step"], rows["slice"], rows["tp"], strict=True))
    leaves = [e for e in m["events"] if e["change"] == "leave"]
    done += [(*u, e["rank"] % 2) for e in leaves for u in e["units_without_row"]]
    assert len(done) == len(set(done))
    units = {(e, st, sl) for e, st, sl, _ in done}
    assert len(units) == 16 * 3 and sorted(done) == sorted((*u, t) for u in units for t in (0, 1))
