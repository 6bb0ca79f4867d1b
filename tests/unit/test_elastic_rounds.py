"""Elastic BSP over the parameter server without Ray (issue 18): a round closes on the pushes of its
members (not a fixed N), a rank enters at a round boundary, a leaver's gradient of the open round is
taken out, k = members - b under backup workers, and the rate follows the round's global batch under
--lr-scaling. The runs themselves: tests/integration/test_elastic_bsp.py."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.strategies.bsp import BSPOverPS
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard

SLOTS = 4


def shard(backups: int = 0, rule: str = "linear") -> ParameterShard:
    return ParameterShard(
        0, SLOTS, ConsistencyRule.elastic_bsp(backups, rule, SLOTS), OptimizerSpec("sgd", 0.0, 0.0), np.zeros(1)
    )


async def push(s: ParameterShard, rank: int, clock: int, g: float, lr: float = 1.0):
    return await s.push_pull(rank, clock, np.array([g], np.float32), lr, clock)


async def closed(task: asyncio.Task, timeout: float = 1.0):
    return await asyncio.wait_for(task, timeout)


async def still_open(task: asyncio.Task) -> bool:
    await asyncio.sleep(0.02)
    return not task.done()


def test_a_round_closes_on_its_members_pushes_and_the_rate_follows_the_round_global_batch():
    async def scenario() -> None:
        s = shard()
        assert await s.set_round_members([0, 1], [0, 1], 0)
        a = asyncio.create_task(push(s, 0, 0, 1.0))
        assert await still_open(a)  # waits for rank 1, a member of round 0
        b = asyncio.create_task(push(s, 1, 0, 3.0))
        ra, rb = await closed(a), await closed(b)
        # mean 2.0 at rate 1.0 x 2/4 (linear: the schedule's rate is for 4 x B, the round had 2 x B)
        assert ra.version == rb.version == 1 and s.theta[0] == pytest.approx(-1.0)
        # Rank 2 joins; the others are in, so it enters at the round after the furthest open one (2).
        assert not await s.set_round_members([0, 1, 2], [2], 0)  # round 0 closed here: refused, unchanged
        assert await s.set_round_members([0, 1, 2], [2], 2)
        assert await s.clock_of(2) == 2
        # Round 1 is still the two old members' alone: it closes without rank 2.
        a = asyncio.create_task(push(s, 0, 1, 1.0))
        b = asyncio.create_task(push(s, 1, 1, 1.0))
        await closed(a), await closed(b)
        assert s.version == 2 and s.round_members[-1] == [0, 1]
        # Round 2 waits for all three; a round of 3 gradients is applied at 3/4 of the rate.
        tasks = [asyncio.create_task(push(s, r, 2, 4.0)) for r in (0, 1)]
        assert await still_open(tasks[0])
        tasks.append(asyncio.create_task(push(s, 2, 2, 4.0)))
        for t in tasks:
            await closed(t)
        assert s.round_members[-1] == [0, 1, 2] and s.theta[0] == pytest.approx(-1.0 - 1.0 * 0.5 - 4.0 * 0.75)
        # Rank 2 leaves after pushing to round 3: its gradient is taken out (its units are redone by
        # others), and the round closes on the remaining members' pushes.
        theta = float(s.theta[0])
        c = asyncio.create_task(push(s, 2, 3, 100.0))
        a = asyncio.create_task(push(s, 0, 3, 2.0))
        assert await still_open(a)
        assert await s.set_round_members([0, 1], [], 0)
        assert await still_open(a)  # rank 1 has not pushed yet
        b = asyncio.create_task(push(s, 1, 3, 2.0))
        await closed(a), await closed(b), await closed(c)
        assert s.round_members[-1] == [0, 1] and s.theta[0] == pytest.approx(theta - 2.0 * 0.5)
        # A push from a rank that is no longer a member (on its way when it left) is dropped at once.
        late = await closed(asyncio.create_task(push(s, 2, 4, 50.0)))
        assert late.dropped and s.version == 4
        # Versions only move forward; every round recorded once.
        assert len(s.round_members) == s.version

    asyncio.run(scenario())


def test_a_member_with_no_work_leaves_the_rounds_and_enters_again_at_the_open_round_when_alone():
    async def scenario() -> None:
        s = shard(rule="sqrt")
        assert await s.set_round_members([0, 1], [0, 1], 0)
        # Rank 1 has no work (a --chaos hold, the end of the run): round 0 closes on rank 0 alone.
        assert await s.set_round_members([0], [], 0)
        r = await closed(asyncio.create_task(push(s, 0, 0, 4.0)))
        assert r.version == 1 and s.theta[0] == pytest.approx(-4.0 * math.sqrt(1 / 4))
        # Nobody in the rounds: the one fed again enters at the open round (nobody pushed to it).
        assert await s.set_round_members([], [], 0)
        assert await s.set_round_members([1], [1], s.version)
        assert await s.clock_of(1) == 1
        r = await closed(asyncio.create_task(push(s, 1, 1, 0.0)))
        assert r.version == 2 and s.round_members[-1] == [1]

    asyncio.run(scenario())


def test_backup_workers_under_a_range_close_each_round_on_members_minus_b():
    async def scenario() -> None:
        s = shard(backups=1)
        assert await s.set_round_members([0, 1, 2], [0, 1, 2], 0)
        a = asyncio.create_task(push(s, 0, 0, 1.0))
        assert await still_open(a)
        b = asyncio.create_task(push(s, 1, 0, 3.0))
        await closed(a), await closed(b)  # k = 3 - 1 = 2
        assert s.round_members[-1] == [0, 1] and s.theta[0] == pytest.approx(-2.0 * 2 / 4)
        late = await closed(asyncio.create_task(push(s, 2, 0, 9.0)))  # the backup's: dropped, counted
        assert late.dropped and late.version == 1 and s.dropped[2] == 1
        # Membership down to 2: k = 1, the first push closes the round.
        assert await s.set_round_members([0, 2], [], 0)
        r = await closed(asyncio.create_task(push(s, 2, 1, 1.0)))
        assert r.version == 2 and s.round_members[-1] == [2]
        # Down to 1 (k would be 0): the round still needs its one push.
        assert await s.set_round_members([0], [], 0)
        r = await closed(asyncio.create_task(push(s, 0, 2, 1.0)))
        assert r.version == 3

    asyncio.run(scenario())


def test_a_range_with_backup_workers_needs_min_above_b_and_counts_the_backups_among_the_members():
    cfg = RunConfig(workers="2..4", strategy="bsp", transport="ps", backup_workers=1, batch_size=8)
    assert cfg.num_worker_actors == 4 and cfg.samples_per_step == 32 and cfg.global_batch_size == 32
    rule = BSPOverPS.ps_rule(cfg)
    assert (rule.mode, rule.backups, rule.slots, rule.lr_scaling, rule.accept) == ("rounds", 1, 4, "linear", None)
    assert BSPOverPS.ps_rule(RunConfig(workers=2, strategy="bsp", transport="ps", backup_workers=1)).accept == 2
    with pytest.raises(ConfigError, match=r"^--workers 1..3 with --backup-workers 1: .* raise MIN above 1$"):
        RunConfig(workers="1..3", strategy="bsp", transport="ps", backup_workers=1)


def test_an_open_round_left_with_no_member_closes_empty_so_the_next_can_open():
    async def scenario() -> None:
        s = shard()
        assert await s.set_round_members([0], [0], 0)
        assert await s.set_round_members([0, 1], [1], 1)  # 0 is in round 0: 1 enters at round 1
        waiting = asyncio.create_task(s.pull_at(1, 1))  # rank 1 waits for θ of its round
        assert await still_open(waiting)
        assert await s.set_round_members([1], [], 0)  # 0 leaves before pushing: round 0 has nobody
        reply = await closed(waiting)
        assert reply.version == 1 and s.theta[0] == 0.0 and s.round_members == [[]]
        r = await closed(asyncio.create_task(push(s, 1, 1, 4.0)))
        assert r.version == 2 and s.round_members[-1] == [1]

    asyncio.run(scenario())
