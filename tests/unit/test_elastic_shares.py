"""--balance speed under --workers MIN..MAX (BSP over the collective), without Ray: the share arithmetic of
a join and a leave (trainers/shares.py `reshare`), the balancer over the members
(orchestrator/elastic_balance.py), and the step rounds (orchestrator/rounds.py `StepRoundPlan`) that cut
every step among whoever is a member, so each (epoch, sample) is trained on once through joins, leaves
and a broken block. The run itself: tests/integration/test_elastic_shares.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.orchestrator.block_dispatcher import BlockDispatcher
from distrain.orchestrator.elastic_balance import ElasticShareBalancer
from distrain.orchestrator.rounds import StepRoundPlan
from distrain.strategies.bsp import ElasticBSP
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.shares import gradient_weight, reshare, slot_shares

B = 48  # the global batch: MAX 3 x --batch-size 16


def test_a_joiner_starts_at_the_mean_share_and_the_sum_stays_the_global_batch():
    assert reshare({}, [0], B) == {0: 48}  # the first member: the whole step
    assert reshare({0: 48}, [0, 2], B) == {0: 24, 2: 24}
    # Balanced 36/12, then slot 2 joins: it comes in at their mean (24 of 48 = 1/2 of the old sum, so
    # 1/3 of the new one), and the others keep their ratio 3:1 in what is left.
    after = reshare({0: 36, 1: 12}, [0, 1, 2], B)
    assert after == {0: 24, 1: 8, 2: 16} and after[2] == B // 3
    # Not divisible: the joiner's share is the mean B / N' to a sample (largest remainder), each >= 1.
    for before in ({0: 47, 1: 1}, {0: 30, 1: 10, 2: 8}, {0: 1, 1: 1, 2: 46}):
        members = [*before, 3]
        shares = reshare(before, members, B)
        assert sum(shares.values()) == B and min(shares.values()) >= 1
        assert abs(shares[3] - B / len(members)) < 1, (before, shares)


def test_a_leavers_share_goes_to_the_others_in_proportion():
    assert reshare({0: 24, 1: 8, 2: 16}, [0, 1], B) == {0: 36, 1: 12}
    assert reshare({0: 24, 1: 8, 2: 16}, [0], B) == {0: 48}
    # A join and a leave at the same re-form: the leaver's share out, the joiner at the stayers' mean.
    assert reshare({0: 30, 1: 18}, [0, 2], B) == {0: 24, 2: 24}
    assert sum(reshare({0: 20, 1: 15, 2: 13}, [1, 2], B).values()) == B


def test_slot_shares_cut_a_step_once_among_the_members_in_slot_order():
    shares = slot_shares({0: 30, 2: 18}, 3)
    assert shares == (30, 0, 18)
    sharder = EpochSharder(480, B, seed=1)
    blocks = [sharder.worker_indices(0, 3, r, 3, shares) for r in range(3)]
    assert [len(b) for b in blocks] == [30, 0, 18]
    assert np.array_equal(np.concatenate(blocks), sharder.global_batch_indices(0, 3))


def feed(balancer: ElasticShareBalancer, per_sample: dict[int, float], rows: int) -> None:
    """`rows` steps of each member (slot -> seconds per sample) at its share now."""
    for _ in range(rows):
        for slot, s in per_sample.items():
            share = balancer.current[balancer.members.index(slot)]
            balancer.add([slot], [share * s], [share])


def test_the_balancer_follows_the_members_a_joiner_at_the_mean_then_measured():
    balancer = ElasticShareBalancer(slots=3, global_batch=B)
    balancer.follow([0, 1], step=0)
    assert balancer.shares_for(0) == (24, 24, 0) and balancer.moves == []
    feed(balancer, {0: 0.001, 1: 0.003}, rows=10)
    assert balancer.shares_for(10) == (36, 12, 0)  # slot 1 three times slower: a quarter
    balancer.follow([0, 1, 2], step=12)  # slot 2 joins at the mean of 36 and 12
    assert balancer.shares_for(12) == (24, 8, 16)
    assert balancer.moves[-1] == {"step": 12, "shares": [24, 8, 16], "joined": [2]}
    feed(balancer, {0: 0.001, 1: 0.003}, rows=20)  # rows of 0 and 1 only: the joiner's speed is unknown
    assert balancer.shares_for(20) == (24, 8, 16)  # nothing moves until the joiner has its rows
    feed(balancer, {0: 0.001, 1: 0.003, 2: 0.001}, rows=10)
    # then by speed, 3:1:3 of 48: a step 1.14x faster, under `at_once`, so seen again in 20 new rows first
    assert balancer.shares_for(30) == (24, 8, 16)
    feed(balancer, {0: 0.001, 1: 0.003, 2: 0.001}, rows=20)
    assert balancer.shares_for(40) == (21, 7, 20)
    balancer.follow([0, 2], step=41)  # slot 1 leaves: its 7 go to the others in proportion
    assert balancer.shares_for(41) == (25, 0, 23)  # 21:20 of 48
    balancer.add([1], [1.0], [7])  # a leaver's late row is not counted (nor an error)
    assert balancer.summary()["final_shares"] == [25, 0, 23] and balancer.summary()["members"] == [0, 2]


def test_a_rejoining_slot_is_measured_afresh():
    balancer = ElasticShareBalancer(slots=2, global_batch=B)
    balancer.follow([0, 1], step=0)
    feed(balancer, {0: 0.001, 1: 0.001}, rows=10)
    balancer.follow([0], step=10)
    balancer.follow([0, 1], step=20)
    assert len(balancer.rows[1]) == 0 and len(balancer.rows[0]) == 10


class Calls:
    def __init__(self) -> None:
        self.ids = itertools.count()
        self.made: list = []

    def __call__(self, kind, rank, payload):
        self.made.append((kind, rank, payload))
        return next(self.ids)


def run_blocks(d: BlockDispatcher, memberships: list[list[int]], broken: int) -> list[dict]:
    """Deal blocks until the plan is done, block i to `memberships[i]` (the last one from there on); every
    member of block `broken` stops after its first round (a peer lost). Each block's deal, as dealt."""
    blocks = []
    for i in itertools.count():
        if d.work.finished:
            return blocks
        d.members, d.turn_taken = memberships[min(i, len(memberships) - 1)], True
        d.feed_all()
        blocks.append(dict(d.block))
        for handle, (_, rank, units) in list(d.pending.items()):
            d.done(handle)
            result = {"step": [e * 4 + s for e, s, _ in units], "slice": [u[2] for u in units]}
            if i == broken:
                result = {k: v[:1] for k, v in result.items()} | {"broken": [{"rounds": 1}]}
            d.collect(rank, units, result)
        d.close()
    raise AssertionError


def test_step_rounds_deal_each_step_to_every_member_once_through_joins_leaves_and_a_broken_block():
    plan = StepRoundPlan(total_steps=12, steps_per_epoch=4)
    d = BlockDispatcher(plan, Calls(), 2)
    # 1 member, then 3 (a join), then a block of 3 broken after its first round, then 2 (a leave).
    blocks = run_blocks(d, [[0], [0, 1, 2], [0, 1, 2], [0, 2]], broken=2)
    assert plan.finished and plan.steps_done == 12
    assert blocks[0] == {0: [(0, 0, 0), (0, 1, 0)]}
    assert blocks[1] == {r: [(0, 2, r), (0, 3, r)] for r in (0, 1, 2)}  # a step a round, a unit each
    assert blocks[2] == {r: [(1, 0, r), (1, 1, r)] for r in (0, 1, 2)}  # broken after (1, 0)
    assert blocks[3] == {r: [(1, 1, r)] for r in (0, 2)}  # the abandoned round first, by the two left
    assert blocks[4] == {r: [(1, 2, r), (1, 3, r)] for r in (0, 2)}
    # Every step stood once: each block's rounds, less the broken block's abandoned one.
    stood = [tuple(u[:2]) for i, b in enumerate(blocks) for u in next(iter(b.values()))[: 1 if i == 2 else None]]
    assert sorted(stood) == [(e, s) for e in range(3) for s in range(4)] and len(stood) == 12
    # Every member had a unit of each of its block's steps (none sat out), the slice its slot.
    assert all(u[2] == rank for b in blocks for rank, units in b.items() for u in units)
    assert plan.units_done == {0: 4, 1: 4, 2: 4}


def test_an_elastic_bsp_unit_weight_makes_a_round_of_shares_a_full_round():
    config = RunConfig(strategy="bsp", workers="1..3", batch_size=16, balance="speed")
    assert config.global_batch_size == B and config.worker_slots == 3
    weights = [gradient_weight(b, 3, B) for b in (30, 0, 18) if b]
    assert sum(weights) == pytest.approx(3)  # applied as MAX units: the rate unscaled, the mean Σ b_i g_i / B
    assert ElasticBSP.weigh_share is not ElasticBSP.__mro__[2].weigh_share  # its own (the raw all-reduce)


@pytest.mark.parametrize(
    "flags, words",
    [
        (dict(worker_weights="3,1,1"), "a weight per rank names no machine"),
        (dict(balance="speed", transport="ps"), "needs the collective transport: the parameter server's elastic"),
        (dict(balance="speed", strategy="async"), "applies to --strategy bsp, local-sgd, diloco, not --strategy async"),
    ],
)
def test_shares_under_a_range_other_than_balanced_collective_bsp_are_refused(flags, words):
    with pytest.raises(ConfigError, match=words):
        RunConfig(**({"workers": "1..3", "batch_size": 16} | flags))


@pytest.mark.parametrize("strategy", ["bsp", "local-sgd", "diloco"])
def test_balanced_shares_under_a_range_are_accepted_over_the_collective(strategy):
    RunConfig(workers="1..3", batch_size=16, balance="speed", strategy=strategy).validate()


def test_an_elastic_blocks_average_weighs_members_by_their_samples_under_balance_speed():
    """block_weight: 1 for a member that stepped, 0 for one that sat out; under --balance speed its samples
    in the block, so members of 40 and 24 samples a step average as 40 : 24 (the whole steps' mean)."""
    from distrain.trainers.shares import ShareTally, block_weight

    tally = ShareTally()
    for _ in range(3):
        tally.add(40, 64)
    assert block_weight(True, tally, took=3) == 120.0
    assert block_weight(False, tally, took=3) == 1.0 and block_weight(False, ShareTally(), took=0) == 0.0


# Cut replicas under a range (--fsdp 2, --workers 1..3, --batch-size 16: B = 3 x 2 x 16 = 96): a slot is a
# replica of 2 worker actors (slot s: ranks 2s, 2s + 1), a share whole units of D = 2 samples.
CUT_B, PER, UNIT = 96, 2, 2


def feed_replicas(balancer: ElasticShareBalancer, per_sample: dict[int, float], rows: int) -> None:
    """`rows` steps of each member's actors (actor -> seconds per sample) at its replica's share now, as a cut
    replica's rows carry it (`replica_samples`; `samples` is the actor's own part)."""
    for _ in range(rows):
        for actor, s in per_sample.items():
            share = balancer.current[balancer.members.index(actor // PER)] * UNIT
            rows_ = {"worker": [actor], "compute_s": [share * s], "samples": [share // PER], "replica_samples": [share]}
            balancer.add_rows(rows_)


def test_the_balancer_over_cut_replicas_moves_whole_units_a_joiner_at_the_mean_a_leavers_share_given_back():
    balancer = ElasticShareBalancer(slots=3, global_batch=CUT_B, per=PER, unit=UNIT)
    balancer.follow([0, 1, 2, 3], step=0)  # the group's actors: replicas 0 and 1
    assert balancer.members == [0, 1] and balancer.shares_for(0) == (48, 48, 0) and balancer.moves == []
    # Replica 1's first worker three times slower (its mate is not: a replica is as slow as its slowest).
    feed_replicas(balancer, {0: 0.001, 1: 0.001, 2: 0.003, 3: 0.001}, rows=10)
    assert balancer.shares_for(10) == (72, 24, 0)  # 36 : 12 units of 2 samples
    balancer.follow([0, 1, 2, 3, 4, 5], step=12)  # replica 2 joins at the mean share, in whole units
    assert balancer.shares_for(12) == (48, 16, 32)  # units 24 : 8 : 16 (the mean of 36 and 12 is 24 of 72)
    assert balancer.moves[-1] == {"step": 12, "shares": [48, 16, 32], "joined": [2]}
    feed_replicas(balancer, {0: 0.001, 1: 0.001, 2: 0.003, 3: 0.001}, rows=20)  # the joiner unmeasured
    assert balancer.shares_for(20) == (48, 16, 32)
    balancer.follow([0, 1, 4, 5], step=21)  # replica 1 leaves: its 8 units go to 0 and 2 as 24 : 16
    assert balancer.shares_for(21) == (58, 0, 38)  # 29 : 19 units (largest remainder), Σ = 96
    balancer.add_rows(
        {"worker": [2], "compute_s": [1.0], "samples": [8], "replica_samples": [16]}
    )  # a leaver's late row
    summary = balancer.summary()
    assert summary["final_shares"] == [58, 0, 38] and summary["members"] == [0, 2]
    for move in balancer.moves:
        assert sum(move["shares"]) == CUT_B and all(b % UNIT == 0 for b in move["shares"]), move
    with pytest.raises(ValueError, match="whole units"):
        ElasticShareBalancer(slots=3, global_batch=95, per=PER, unit=UNIT)


def test_step_rounds_over_cut_replicas_give_each_worker_its_data_parallel_ranks_slice():
    """A step's unit for every member actor: slice = actor // T (its data-parallel rank, slot x D + d; a
    rank's T tensor-parallel workers share it), whose part of its replica's share tiles the step with the
    others' (a slot without a member: 0)."""
    plan = StepRoundPlan(total_steps=4, steps_per_epoch=4, per_unit=2)  # D = 2, T = 2: 4 actors a replica
    members = [0, 1, 2, 3, 8, 9, 10, 11]  # replicas 0 and 2 of MAX 3
    block = plan.deal(members, rounds=2)
    assert block == {a: [(0, 0, a // 2), (0, 1, a // 2)] for a in members}
    sharder = EpochSharder(1000, CUT_B, seed=0)
    shares = (40, 0, 56)  # per slot, each cut into D = 2 equal parts
    slices = sorted({u[2] for units in block.values() for u in units})
    assert slices == [0, 1, 4, 5]
    parts = [sharder.worker_indices(0, 0, s, 6, shares, cut=2) for s in slices]
    assert [len(p) for p in parts] == [20, 20, 28, 28]
    assert np.array_equal(np.concatenate(parts), sharder.global_batch_indices(0, 0))


@pytest.mark.parametrize("strategy", ["bsp", "local-sgd", "diloco"])
@pytest.mark.parametrize(
    "layout",
    [dict(fsdp=2), dict(tensor_parallel=2), dict(model="cnn", tensor_parallel=2)],  # the cnn's: a hybrid plan
)
def test_balanced_shares_across_cut_replicas_under_a_range_are_accepted_weights_refused(strategy, layout):
    base = dict(model="mlp", workers="1..3", batch_size=16, strategy=strategy) | layout
    RunConfig(**base, balance="speed").validate()
    with pytest.raises(ConfigError, match="a weight per rank names no machine"):
        RunConfig(**base, worker_weights="3,1,1").validate()
