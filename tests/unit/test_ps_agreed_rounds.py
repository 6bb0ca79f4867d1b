"""k-of-n rounds across cut replicas (strategies/ps_shard.py `RoundReferee`), in-process (no Ray): a
replica pushes piece d of its gradient to shard d alone, and the D shards must apply the same replicas'
gradients every round, whatever order the pieces arrive in at each shard."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from distrain.strategies.bsp import rounds_disagreeing
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard, RoundReferee

SGD = OptimizerSpec("sgd", 0.0, 0.0)
LR = 0.5


def grad(client: int, shard: int) -> np.ndarray:
    """Client c's piece for shard d: distinct per client and shard, so a wrong member shows in θ."""
    return np.array([client + 1.0, 10.0 * (client + 1) + shard], np.float32)


def handle_of(shard: ParameterShard) -> SimpleNamespace:
    """What a Ray actor handle offers the other shards: `agree.remote(...)`, awaitable."""
    return SimpleNamespace(agree=SimpleNamespace(remote=shard.agree))


def agreed_shards(accept: int, clients: int, parts: int) -> list[ParameterShard]:
    rule = ConsistencyRule.bsp(accept=accept, parts=parts)
    first = ParameterShard(0, clients, rule, SGD, np.zeros(2, np.float32))
    rest = [
        ParameterShard(d, clients, rule, SGD, np.zeros(2, np.float32), referee=handle_of(first))
        for d in range(1, parts)
    ]
    return [first, *rest]


# Pieces in an order where shards deciding apart disagree: shard 0 sees replicas 2 and 0 first, shard 1
# sees 0 and 1 first; replica 0 is complete third, replica 1 fifth, replica 2 last.
ORDER = [(0, 2), (0, 0), (1, 0), (1, 1), (0, 1), (1, 2)]


async def push_in_order(shards: list[ParameterShard], order=ORDER, round_=0) -> dict[tuple[int, int], object]:
    tasks = {}
    for shard, client in order:
        tasks[shard, client] = asyncio.create_task(shards[shard].push_pull(client, round_, grad(client, shard), LR, 0))
        await asyncio.sleep(0.01)
    return {key: await task for key, task in tasks.items()}


def test_the_shards_apply_the_first_replicas_complete_everywhere_not_each_its_own_first():
    """N = 2 of 3 replicas, D = 2: the round is replicas {0, 1} (the first two whose both pieces arrived)
    at both shards, though shard 0 had replica 2's piece before replica 1's; replica 2 is dropped at both."""

    async def scenario():
        shards = agreed_shards(accept=2, clients=3, parts=2)
        return shards, await push_in_order(shards)

    shards, replies = asyncio.run(scenario())
    for d, shard in enumerate(shards):
        expected = -LR * (grad(0, d) + grad(1, d)) / 2
        np.testing.assert_allclose(shard.theta, expected)
        assert shard.version == 1 and shard.round_members == [[0, 1]] and shard.dropped == [0, 0, 1]
        assert [replies[d, c].dropped for c in range(3)] == [False, False, True]
        assert all(replies[d, c].version == 1 for c in range(3))
        assert replies[d, 2].applied_version == -1 and replies[d, 2].lag == 1
    assert rounds_disagreeing([s.round_members for s in shards]) == 0


def test_without_the_referee_the_same_order_splits_the_model():
    """The hazard the referee removes: plain k-of-n shards (each deciding alone) given the same pieces in
    the same order apply {0, 2} on shard 0 and {0, 1} on shard 1, and the record says so."""

    async def scenario():
        rule = ConsistencyRule.bsp(accept=2)
        shards = [ParameterShard(d, 3, rule, SGD, np.zeros(2, np.float32)) for d in range(2)]
        await push_in_order(shards)
        return shards

    shards = asyncio.run(scenario())
    assert [s.round_members for s in shards] == [[[0, 2]], [[0, 1]]]
    assert rounds_disagreeing([s.round_members for s in shards]) == 1


def test_a_dropped_replica_goes_on_at_the_next_round_and_can_count_there():
    """Round 0 closes on {0, 1}; replica 2 came late and pushes for round 1, where it is among the first
    two complete (replica 1 is late now): round 1 is {0, 2} on both shards, θ the SGD steps of those."""

    async def scenario():
        shards = agreed_shards(accept=2, clients=3, parts=2)
        await push_in_order(shards)
        second = [(0, 0), (1, 0), (1, 2), (0, 1), (0, 2), (1, 1)]
        return shards, await push_in_order(shards, second, round_=1)

    shards, replies = asyncio.run(scenario())
    for d, shard in enumerate(shards):
        first = -LR * (grad(0, d) + grad(1, d)) / 2
        np.testing.assert_allclose(shard.theta, first - LR * (grad(0, d) + grad(2, d)) / 2)
        assert shard.round_members == [[0, 1], [0, 2]] and shard.dropped == [0, 1, 1]
        assert [replies[d, c].dropped for c in range(3)] == [False, True, False]


def test_a_skipped_piece_counts_the_replica_and_adds_nothing():
    """--on-nonfinite skip: a replica's D workers skip together, so its pieces are all None; it still
    completes (it took part) and the round applies the mean of the other member's gradient."""

    async def scenario():
        shards = agreed_shards(accept=2, clients=3, parts=2)
        tasks = []
        for d in range(2):
            tasks.append(asyncio.create_task(shards[d].push_pull(0, 0, None, LR, 0)))
            tasks.append(asyncio.create_task(shards[d].push_pull(1, 0, grad(1, d), LR, 0)))
        await asyncio.gather(*tasks)
        return shards

    shards = asyncio.run(scenario())
    for d, shard in enumerate(shards):
        np.testing.assert_allclose(shard.theta, -LR * grad(1, d))
        assert shard.round_members == [[0, 1]]


def test_the_referee_answers_a_late_piece_with_the_decided_round_and_forgets_old_rounds():
    async def scenario():
        referee = RoundReferee(accept=1, parts=2)
        answers = []
        for round_ in range(6):
            waiting = asyncio.create_task(referee.agree(round_, 1, 0))
            await asyncio.sleep(0)
            assert not waiting.done(), "a client is complete only with every piece"
            answers.append(await asyncio.gather(referee.agree(round_, 0, 0), referee.agree(round_, 0, 1)))
            assert await waiting == [0]
            assert await referee.agree(round_, 1, 1) == [0]  # after the decision: told, not counted
        return referee, answers

    referee, answers = asyncio.run(scenario())
    assert answers == [[[0], [0]]] * 6
    assert sorted(referee.decided) == [2, 3, 4, 5] and not referee.pieces and not referee.complete


def test_a_shard_other_than_0_needs_the_referee_handle():
    with pytest.raises(ValueError, match="need shard 0's handle"):
        ParameterShard(1, 3, ConsistencyRule.bsp(accept=2, parts=2), SGD, np.zeros(2, np.float32))


def test_the_closing_table_names_replicas_and_the_shards_agreement_for_cut_replicas():
    from distrain.commands.run_summary import _straggler_rows

    cut = dict(_straggler_rows({"dropped_gradients": {"0": 0, "1": 5}, "rounds_shards_disagree": 0}))
    assert cut["gradients dropped as late/duplicate, by replica"] == "5 (0:0 1:5)"
    assert cut["rounds the PS shards disagreed on"] == "0"
    plain = dict(_straggler_rows({"dropped_gradients": {"0": 1, "1": 2}}))
    assert plain == {"gradients dropped as late/duplicate": "3 (0:1 1:2)"}
