"""Parameter-server shard rules, in-process (no Ray): partitioning, SSP admission, rounds, snapshots."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from distrain.strategies.partition import partition
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard

SGD = OptimizerSpec("sgd", 0.0, 0.0)


@pytest.mark.parametrize("n, k", [(10, 1), (10, 3), (151306, 4), (7, 7), (1000003, 2)])
def test_partition_covers_the_vector_once_with_balanced_contiguous_slices(n, k):
    bounds = partition(n, k)
    assert len(bounds) == k
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    covered = np.zeros(n, dtype=int)
    for start, stop in bounds:
        covered[start:stop] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize("n, k", [(5, 0), (5, 6)])
def test_partition_refuses_impossible_splits(n, k):
    with pytest.raises(ValueError):
        partition(n, k)


def shard(rule: ConsistencyRule, workers: int, theta=(0.0, 0.0), optimizer=SGD) -> ParameterShard:
    return ParameterShard(0, workers, rule, optimizer, np.array(theta, dtype=np.float32))


def test_bsp_round_applies_the_mean_once_all_workers_pushed():
    async def scenario():
        s = shard(ConsistencyRule.bsp(), 2)
        first = asyncio.create_task(s.push_pull(0, 0, np.array([1.0, 2.0], np.float32), 0.5, 0))
        await asyncio.sleep(0.01)
        assert not first.done(), "a BSP push must wait for the round to fill"
        assert s.version == 0
        second = await s.push_pull(1, 0, np.array([3.0, 6.0], np.float32), 0.5, 0)
        first = await first
        return s, first, second

    s, first, second = asyncio.run(scenario())
    expected = -0.5 * np.array([2.0, 4.0])  # θ - η * mean(g)
    np.testing.assert_allclose(first.theta, expected)
    np.testing.assert_allclose(second.theta, expected)
    assert s.version == 1 and first.version == second.version == 1
    assert first.wait_s > 0 and second.wait_s == 0
    assert first.lag == second.lag == 0


def test_bounded_rule_applies_on_arrival_at_rate_over_n_and_reports_staleness():
    async def scenario():
        s = shard(ConsistencyRule.asynchronous(), 2)
        a = await s.push_pull(0, 0, np.array([1.0, 1.0], np.float32), 1.0, 0)
        b = await s.push_pull(1, 0, np.array([1.0, 1.0], np.float32), 1.0, 0)  # computed on version 0
        return a, b

    a, b = asyncio.run(scenario())
    np.testing.assert_allclose(a.theta, [-0.5, -0.5])  # η/N per gradient
    np.testing.assert_allclose(b.theta, [-1.0, -1.0])
    assert (a.applied_version, a.lag) == (0, 0)
    assert (b.applied_version, b.lag) == (1, 1)


def test_staleness_aware_rate_divides_by_tau():
    async def scenario():
        s = shard(ConsistencyRule.asynchronous(staleness_lr=True), 1, theta=(0.0,))
        for _ in range(3):
            await s.push_pull(0, 0, np.array([0.0], np.float32), 1.0, s.version)
        return await s.push_pull(0, 3, np.array([1.0], np.float32), 1.0, 0)  # read at 0, applied at 3

    reply = asyncio.run(scenario())
    assert reply.lag == 3
    np.testing.assert_allclose(reply.theta, [-1.0 / 3])


def test_ssp_pull_blocks_exactly_while_the_clock_lead_exceeds_s():
    async def scenario():
        s = shard(ConsistencyRule.ssp(1), 2)
        g = np.zeros(2, np.float32)
        r = await s.push_pull(0, 0, g, 0.1, 0)  # worker 0: clock 1, worker 1 at 0 -> lead 1 <= 1
        assert r.clock - r.min_clock == 1 and r.wait_s == 0
        blocked = asyncio.create_task(s.push_pull(0, 1, g, 0.1, 1))  # clock 2, lead 2 > 1: waits
        await asyncio.sleep(0.02)
        assert not blocked.done()
        await s.push_pull(1, 0, g, 0.1, 0)  # the slow worker advances to clock 1
        r = await asyncio.wait_for(blocked, 1.0)
        return r

    r = asyncio.run(scenario())
    assert r.clock == 2 and r.min_clock == 1 and r.wait_s > 0.01


def test_ssp_zero_serves_every_worker_the_same_theta_per_clock():
    async def scenario():
        s = shard(ConsistencyRule.ssp(0), 2)
        a = asyncio.create_task(s.push_pull(0, 0, np.array([1.0, 0.0], np.float32), 1.0, 0))
        await asyncio.sleep(0.01)
        assert not a.done()
        b = await s.push_pull(1, 0, np.array([0.0, 1.0], np.float32), 1.0, 0)
        return await a, b

    a, b = asyncio.run(scenario())
    np.testing.assert_allclose(a.theta, b.theta)
    np.testing.assert_allclose(a.theta, [-0.5, -0.5])  # θ - η * mean(g), as one BSP step


def test_snapshot_restore_round_trips_theta_optimizer_state_version_and_clocks():
    async def scenario():
        momentum = OptimizerSpec("sgd", 0.9, 0.0)
        s = shard(ConsistencyRule.ssp(3), 2, theta=(1.0, 2.0, 3.0), optimizer=momentum)
        for clock in range(3):
            await s.push_pull(0, clock, np.array([0.1, 0.2, 0.3], np.float32), 0.5, s.version)
        snap = await s.snapshot()
        fresh = shard(ConsistencyRule.ssp(3), 2, theta=(0.0, 0.0, 0.0), optimizer=momentum)
        await fresh.restore(snap)
        g = np.array([1.0, -1.0, 0.5], np.float32)
        original = await s.push_pull(1, 0, g, 0.5, 3)
        restored = await fresh.push_pull(1, 0, g, 0.5, 3)
        return snap, original, restored

    snap, original, restored = asyncio.run(scenario())
    assert snap["version"] == 3 and snap["clocks"] == [3, 0]
    assert snap["optimizer"]["vectors"]["momentum_buffer"].abs().sum() > 0
    np.testing.assert_array_equal(original.theta, restored.theta)
    assert original.version == restored.version == 4


def test_rebased_clock_keeps_a_blocked_ssp_worker_waiting_until_the_replacement_pushes():
    """A replaced worker's clock goes back to its confirmed clock: the worker blocked on it stays
    blocked (lowering a clock releases nobody), and the replacement's pushes release it."""

    async def scenario():
        s = shard(ConsistencyRule.ssp(1), 2)
        g = np.ones(2, np.float32)
        await s.push_pull(1, 0, g, 0.1, 0)  # worker 1 (about to die) pushed clock 0
        await s.push_pull(0, 0, g, 0.1, 0)
        blocked = asyncio.create_task(s.push_pull(0, 1, g, 0.1, 0))  # clock 2 vs min 1: within s = 1
        await blocked
        blocked = asyncio.create_task(s.push_pull(0, 2, g, 0.1, 0))  # clock 3 vs min 1: waits
        await asyncio.sleep(0.01)
        assert not blocked.done()
        assert await s.rebase_clock(1, 0) == 1  # the replacement redoes worker 1's clock 0
        await asyncio.sleep(0.01)
        assert not blocked.done() and (await s.counters())["clocks"] == [3, 0]
        await s.push_pull(1, 0, g, 0.1, 0)  # replacement: clock 1, still 2 behind
        await asyncio.sleep(0.01)
        assert not blocked.done()
        await s.push_pull(1, 1, g, 0.1, 0)  # clock 2: worker 0 (at 3) is within the bound again
        reply = await asyncio.wait_for(blocked, 1.0)
        return s, reply

    s, reply = asyncio.run(scenario())
    assert reply.clock == 3 and reply.min_clock == 2 and reply.wait_s > 0
    assert s.updates_applied == 6  # worker 1's first push stands and is repeated (updates_repeated)


# ---------------------------------------------------------------- --on-nonfinite skip: a push without a gradient
def test_a_bsp_round_with_a_skipped_push_applies_the_mean_of_the_others():
    async def scenario():
        s = shard(ConsistencyRule.bsp(), 3)
        waiting = [
            asyncio.create_task(s.push_pull(0, 0, np.array([2.0, 4.0], np.float32), 1.0, 0)),
            asyncio.create_task(s.push_pull(1, 0, None, 1.0, 0)),  # non-finite: nothing pushed
        ]
        await asyncio.sleep(0.01)
        assert s.version == 0, "the skipped push still counts towards the round"
        last = await s.push_pull(2, 0, np.array([4.0, 8.0], np.float32), 1.0, 0)
        await asyncio.gather(*waiting)
        return s, last

    s, last = asyncio.run(scenario())
    np.testing.assert_allclose(s.theta, [-3.0, -6.0])  # mean of the two gradients, not of three
    assert s.version == 1 and last.clock == 1 and s.round_members == [[0, 1, 2]]


def test_a_bsp_round_of_only_skipped_pushes_closes_with_theta_unchanged():
    async def scenario():
        s = shard(ConsistencyRule.bsp(), 2, theta=(1.0, 1.0))
        first = asyncio.create_task(s.push_pull(0, 0, None, 1.0, 0))
        await s.push_pull(1, 0, None, 1.0, 0)
        await first
        return s

    s = asyncio.run(scenario())
    np.testing.assert_array_equal(s.theta, [1.0, 1.0])
    assert s.version == 1 and s.clocks == [1, 1] and s.updates_applied == 0


def test_a_skipped_async_push_moves_only_the_clock():
    s = shard(ConsistencyRule.asynchronous(), 2, theta=(1.0, 1.0))
    reply = asyncio.run(s.push_pull(0, 0, None, 1.0, 0))
    np.testing.assert_array_equal(s.theta, [1.0, 1.0])
    assert s.version == 0 and reply.clock == 1 and s.clocks == [1, 0]


def test_a_skipped_portion_counts_as_done_and_the_round_averages_the_others():
    async def scenario():
        s = shard(ConsistencyRule.backup_tasks(3), 2)
        assert await s.push_portion(0, 0, 0, np.array([3.0, 3.0], np.float32), 1.0)
        assert await s.push_portion(1, 0, 1, None, 1.0)
        assert await s.push_portion(0, 0, 2, np.array([1.0, 1.0], np.float32), 1.0)
        return s

    s = asyncio.run(scenario())
    np.testing.assert_allclose(s.theta, [-2.0, -2.0])
    assert s.version == 1


# ---------------------------------------------------------------------- a task's own scheduler on a shard
class _StepTask:
    """What a shard builds from a task's config: SGD at 1.0, halved every 2 updates by a StepLR."""

    def configure_optimizers(self, params):
        import torch

        optimizer = torch.optim.SGD(params, lr=1.0)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _own_shard(theta=(0.0, 0.0), optimizer_state=None) -> ParameterShard:
    from distrain.trainers.task import Task

    class StepTask(_StepTask, Task):
        pass

    spec = OptimizerSpec("sgd", 0.0, 0.0, task_config="any", task_builder=lambda config: StepTask())
    return ParameterShard(0, 1, ConsistencyRule.bsp(), spec, np.array(theta, np.float32), optimizer_state)


def _updates(s: ParameterShard, grads: list) -> list[float]:
    """Push each of `grads` (None: a skipped step) as worker 0's next round; the rate after each."""

    async def scenario():
        rates = []
        for g in grads:
            await s.push_pull(0, s.version, None if g is None else np.array(g, np.float32), 0.0, s.version)
            rates.append(s.optimizer.param_groups[0]["lr"])
        return rates

    return asyncio.run(scenario())


def test_a_shard_steps_a_task_scheduler_once_per_update_applied_not_per_round():
    """An empty round (every gradient skipped) moves the version, not the rates: the rule a replica's
    skipped step follows."""
    s = _own_shard()
    rates = _updates(s, [[1.0, 1.0], None, [1.0, 1.0], [1.0, 1.0], None])
    assert s.version == 5 and s.scheduler.last_epoch == 3
    assert rates == [1.0, 1.0, 0.5, 0.5, 0.5]
    np.testing.assert_allclose(s.theta, [-2.5, -2.5])  # updates at 1.0, 1.0 and 0.5 (the empty round: none)


def test_a_shard_resumed_from_its_snapshot_goes_on_at_the_scheduler_s_position():
    """3 updates, a snapshot (a checkpoint's "ps" counters and flat state), a new shard from it: the
    next 3 updates are those of the shard taken straight through; without the scheduler's state the new
    one would start again at rate 1.0."""
    from distrain.strategies.ps_client import counters_of

    grads = [[1.0, -1.0], [0.5, 2.0], None, [1.0, 1.0], [2.0, 0.0], [1.0, 3.0], [0.5, 0.5]]
    straight = _own_shard()
    straight_rates = _updates(straight, grads)
    first = _own_shard()
    _updates(first, grads[:4])
    snap = asyncio.run(first.snapshot())
    counters = counters_of(snap)
    assert counters["scheduler"]["last_epoch"] == 3 and counters["version"] == 4
    resumed = _own_shard(snap["theta"], snap["optimizer"])
    asyncio.run(resumed.set_counters(counters["version"], counters["clocks"], counters["scheduler"]))
    assert _updates(resumed, grads[4:]) == straight_rates[4:]
    np.testing.assert_array_equal(resumed.theta, straight.theta)
    restored = _own_shard()  # recovery's path: a running shard restored to the snapshot
    asyncio.run(restored.restore(snap))
    assert _updates(restored, grads[4:]) == straight_rates[4:]
    np.testing.assert_array_equal(restored.theta, straight.theta)


def test_a_shard_without_a_task_scheduler_keeps_its_counters_as_they_were():
    from distrain.strategies.ps_client import counters_of

    assert set(counters_of(asyncio.run(shard(ConsistencyRule.bsp(), 1).snapshot()))) == {"version", "clocks"}
