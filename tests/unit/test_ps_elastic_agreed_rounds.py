"""k-of-n rounds across cut replicas under --workers MIN..MAX (strategies/ps_shard.py `RoundReferee` with
elastic members), in-process (no Ray): the referee on shard 0 decides each round from shard 0's members
of that round (the first max(1, members - K) complete), a membership change reaches shard 0 first and
is decided there, and every shard applies exactly the referee's answer, never closing a round on its own
view. The fixed-size referee: test_ps_agreed_rounds.py; plain elastic rounds: test_elastic_rounds.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from distrain.strategies.bsp import rounds_disagreeing
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard

SGD = OptimizerSpec("sgd", 0.0, 0.0)
LR = 0.5
SLOTS = 3


def grad(client: int, shard: int) -> np.ndarray:
    """Client c's piece for shard d: distinct per client and shard, so a wrong member shows in θ."""
    return np.array([client + 1.0, 10.0 * (client + 1) + shard], np.float32)


def handle_of(shard: ParameterShard, gate: asyncio.Event | None = None) -> SimpleNamespace:
    """What shard 0's Ray actor handle offers the others (`agree`, `decision`), awaitable; with `gate`, the
    referee's answers to this shard's pushes are held until it is set (a slow answer on the wire)."""

    async def agree(round_, client, part):
        answer = await shard.agree(round_, client, part)
        if gate is not None:
            await gate.wait()
        return answer

    return SimpleNamespace(agree=SimpleNamespace(remote=agree), decision=SimpleNamespace(remote=shard.decision))


def elastic_shards(backups: int, parts: int = 2, gate: asyncio.Event | None = None) -> list[ParameterShard]:
    rule = ConsistencyRule.elastic_bsp(backups, "none", SLOTS, parts=parts)  # "none": the rate is LR
    first = ParameterShard(0, SLOTS, rule, SGD, np.zeros(2, np.float32))
    rest = [
        ParameterShard(d, SLOTS, rule, SGD, np.zeros(2, np.float32), referee=handle_of(first, gate))
        for d in range(1, parts)
    ]
    return [first, *rest]


async def set_members(shards, members, entering=(), start=0) -> bool:
    """As the driver does (orchestrator/controller/ray_group.py): shard 0 first, then the others."""
    if not await shards[0].set_round_members(list(members), list(entering), start):
        return False
    return all([await s.set_round_members(list(members), list(entering), start) for s in shards[1:]])


def push(shards, shard: int, client: int, round_: int = 0) -> asyncio.Task:
    return asyncio.create_task(shards[shard].push_pull(client, round_, grad(client, shard), LR, round_))


async def pushed(shards, order, round_=0) -> dict:
    tasks = {}
    for shard, client in order:
        tasks[shard, client] = push(shards, shard, client, round_)
        await asyncio.sleep(0.01)
    return tasks


def mean_step(clients, d) -> np.ndarray:
    return -LR * sum(grad(c, d) for c in clients) / len(clients)


def test_a_round_closes_on_members_minus_backups_complete_replicas_the_same_at_every_shard():
    """3 member replicas, K = 1, D = 2: the round is the first 2 complete ({0, 1}) at both shards, though
    shard 0 had replica 2's piece before replica 1's; replica 2 is dropped at both."""

    async def scenario():
        shards = elastic_shards(backups=1)
        assert await set_members(shards, [0, 1, 2], [0, 1, 2], 0)
        tasks = await pushed(shards, [(0, 2), (0, 0), (1, 0), (1, 1), (0, 1), (1, 2)])
        return shards, {k: await asyncio.wait_for(t, 1.0) for k, t in tasks.items()}

    shards, replies = asyncio.run(scenario())
    for d, shard in enumerate(shards):
        np.testing.assert_allclose(shard.theta, mean_step([0, 1], d))
        assert shard.version == 1 and shard.round_members == [[0, 1]] and shard.dropped == [0, 0, 1]
        assert [replies[d, c].dropped for c in range(3)] == [False, False, True]
    assert rounds_disagreeing([s.round_members for s in shards]) == 0


def test_a_leave_takes_the_leavers_pieces_out_and_closes_the_round_on_the_rest():
    """3 members, K = 1 (2 a round): replica 0 complete, replica 2's piece at shard 0 only (it is leaving).
    Its leave makes the round 1 of 2 members: replica 0 alone closes it at both shards, its piece no longer
    counts, and its push at shard 0 is answered dropped; a piece it sends after its leave is dropped at once."""

    async def scenario():
        shards = elastic_shards(backups=1)
        assert await set_members(shards, [0, 1, 2], [0, 1, 2], 0)
        tasks = await pushed(shards, [(0, 0), (1, 0), (0, 2)])
        await asyncio.sleep(0.02)
        assert not any(t.done() for t in tasks.values())  # 1 complete of the 2 the round needs
        assert await set_members(shards, [0, 1])
        replies = {k: await asyncio.wait_for(t, 1.0) for k, t in tasks.items()}
        late = await asyncio.wait_for(push(shards, 1, 2, round_=1), 1.0)  # a leaver's piece still on its way
        return shards, replies, late

    shards, replies, late = asyncio.run(scenario())
    for d, shard in enumerate(shards):
        np.testing.assert_allclose(shard.theta, mean_step([0], d))
        assert shard.version == 1 and shard.round_members == [[0]]
    assert not replies[0, 0].dropped and not replies[1, 0].dropped and replies[0, 2].dropped
    assert late.dropped and late.version == 1 and shards[1].dropped == [0, 0, 1] and not shards[1].round


def test_a_leavers_piece_stays_at_a_shard_until_it_applies_a_decision_that_counts_it():
    """Replicas 0 and 1 complete (K = 1 of 3: the round is {0, 1}, decided), but shard 1 hears the referee's
    answer only after replica 1's leave reached it: shard 1 must still hold replica 1's piece and apply
    {0, 1} as shard 0 did (a shard taking the leaver's piece out on its own view could not)."""

    async def scenario():
        gate = asyncio.Event()
        shards = elastic_shards(backups=1, gate=gate)
        assert await set_members(shards, [0, 1, 2], [0, 1, 2], 0)
        tasks = await pushed(shards, [(0, 0), (1, 0), (0, 1), (1, 1)])
        await asyncio.sleep(0.02)
        assert shards[0].version == 1 and shards[1].version == 0  # decided; shard 1 not told yet
        assert await set_members(shards, [0, 2])
        gate.set()
        return shards, {k: await asyncio.wait_for(t, 1.0) for k, t in tasks.items()}

    shards, replies = asyncio.run(scenario())
    for d, shard in enumerate(shards):
        np.testing.assert_allclose(shard.theta, mean_step([0, 1], d))
        assert shard.round_members == [[0, 1]]
    assert not any(r.dropped for r in replies.values())


def test_a_round_without_a_member_closes_empty_at_every_shard_and_the_next_one_opens():
    """Replica 0, the only member of round 0, pushed its piece to shard 0 only and leaves while replica 1
    enters at round 1: round 0 has no member and closes empty at both shards (shard 1 never had a piece
    of it: it learns the referee's answer from the membership change), and round 1 closes on replica 1."""

    async def scenario():
        shards = elastic_shards(backups=1)
        assert await set_members(shards, [0], [0], 0)
        leaver = push(shards, 0, 0)
        await asyncio.sleep(0.02)
        assert await set_members(shards, [1], [1], 1)
        assert [s.version for s in shards] == [1, 1]
        gone = await asyncio.wait_for(leaver, 1.0)
        both = asyncio.gather(push(shards, 1, 1, round_=1), push(shards, 0, 1, round_=1))
        replies = await asyncio.wait_for(both, 1.0)
        return shards, gone, replies

    shards, gone, replies = asyncio.run(scenario())
    assert gone.dropped and not any(r.dropped for r in replies)
    for d, shard in enumerate(shards):
        np.testing.assert_allclose(shard.theta, -LR * grad(1, d))
        assert shard.version == 2 and shard.round_members == [[], [1]]
    assert rounds_disagreeing([s.round_members for s in shards]) == 0


def test_an_entering_replica_is_refused_a_round_the_referee_has_decided():
    """The driver names the round a replica enters at; shard 0 refuses one already decided (its pushes would
    all come late), as every shard refuses one it has applied, and nothing changes then."""

    async def scenario():
        gate = asyncio.Event()
        shards = elastic_shards(backups=0, gate=gate)
        assert await set_members(shards, [0], [0], 0)
        tasks = await pushed(shards, [(0, 0), (1, 0)])
        await asyncio.sleep(0.02)
        refused = not await set_members(shards, [0, 1], [1], 0)
        gate.set()
        await asyncio.gather(*tasks.values())
        return shards, refused

    shards, refused = asyncio.run(scenario())
    assert refused and all(s.members == [0] and 1 not in s.enters for s in shards)
