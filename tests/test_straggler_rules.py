"""Straggler handling without Ray: k-of-n and portion rules in a shard, the portion scheduler, detection."""

from __future__ import annotations

import asyncio

import numpy as np

from distrain.orchestrator.backup_tasks import PortionScheduler
from distrain.orchestrator.stragglers import StragglerDetector
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard

SGD = OptimizerSpec("sgd", 0.0, 0.0)


def g(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_k_of_n_round_applies_the_first_n_gradients_and_drops_the_late_one():
    async def scenario():
        s = ParameterShard(0, 3, ConsistencyRule.bsp(accept=2), SGD, g(0.0, 0.0))
        first = asyncio.create_task(s.push_pull(2, 0, g(1.0, 2.0), 1.0, 0))
        await asyncio.sleep(0.01)
        assert not first.done() and s.version == 0
        second = await s.push_pull(0, 0, g(3.0, 6.0), 1.0, 0)  # the second gradient closes round 0
        first = await first
        late = await s.push_pull(1, 0, g(100.0, 100.0), 1.0, 0)  # round 0 is closed: dropped
        return s, first, second, late

    s, first, second, late = asyncio.run(scenario())
    np.testing.assert_allclose(second.theta, [-2.0, -4.0])  # θ - η·mean(first two), the late one ignored
    np.testing.assert_allclose(late.theta, second.theta)
    assert not first.dropped and not second.dropped and late.dropped
    assert late.version == 1 and late.applied_version == -1 and late.staleness == 1
    assert s.version == 1 and s.dropped == [0, 1, 0]
    assert s.round_members == [[0, 2]]


def test_k_of_n_skips_a_worker_ahead_when_rounds_closed_without_it():
    async def scenario():
        s = ParameterShard(0, 3, ConsistencyRule.bsp(accept=2), SGD, g(0.0))
        for round_ in range(3):  # workers 0 and 1 run three rounds on their own
            await asyncio.gather(*(s.push_pull(w, round_, g(1.0), 1.0, round_) for w in (0, 1)))
        return s, await s.push_pull(2, 0, g(5.0), 1.0, 0)

    s, late = asyncio.run(scenario())
    assert late.dropped and late.version == 3 and s.version == 3
    np.testing.assert_allclose(late.theta, [-3.0])
    assert s.round_members == [[0, 1]] * 3


def test_portions_rule_keeps_the_first_copy_of_each_portion_and_applies_the_mean_of_all():
    async def scenario():
        s = ParameterShard(0, 2, ConsistencyRule.backup_tasks(3), SGD, g(0.0))
        kept = [await s.push_portion(0, 0, 0, g(3.0), 1.0), await s.push_portion(1, 0, 1, g(6.0), 1.0)]
        kept.append(await s.push_portion(0, 0, 1, g(6.0), 1.0))  # a copy of portion 1: dropped
        assert s.version == 0
        kept.append(await s.push_portion(1, 0, 2, g(9.0), 1.0))  # the last portion closes the round
        kept.append(await s.push_portion(0, 0, 2, g(9.0), 1.0))  # a copy arriving after the round
        return s, kept

    s, kept = asyncio.run(scenario())
    assert kept == [True, True, False, True, False]
    assert s.version == 1 and s.round_members == [[0, 1, 2]]
    np.testing.assert_allclose(s.theta, [-6.0])  # mean of 3, 6, 9 applied once
    assert s.dropped == [2, 0]


async def pushed() -> bool:  # stands for a shard's reply to the push (an object ref in a real run)
    return True


async def take(scheduler: PortionScheduler, worker: int, finished=None, upto=(0, 0)):
    if finished is not None:
        finished = (*finished, [pushed()])
    return await asyncio.wait_for(scheduler.acquire(worker, finished, *upto), timeout=1.0)


def test_scheduler_hands_out_every_portion_once_then_copies_outstanding_ones():
    async def scenario():
        sched = PortionScheduler(portions=3, steps_per_epoch=10, start_step=0)
        a = [await take(sched, 0), await take(sched, 1), await take(sched, 0)]
        assert [x.portion for x in a] == [0, 1, 2] and not any(x.copy for x in a)
        # Worker 0 is done with portion 0 and asks again: all are handed out, so it gets a copy
        # of the longest-running portion it does not hold (portion 1, held by worker 1).
        copy = await take(sched, 0, finished=(0, 0))
        assert copy.copy and copy.portion == 1
        # Nothing left to copy for worker 0 (portion 2 is its own): it waits for the round to close.
        waiting = asyncio.create_task(take(sched, 0, finished=(0, 1)))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        # Worker 1's twin of portion 1 is ignored (no double count); it is free, so it gets a copy
        # of portion 2, which only worker 0 holds.
        copy2 = await take(sched, 1, finished=(0, 1))
        assert copy2.copy and copy2.portion == 2
        done = await take(sched, 1, finished=(0, 2))  # round 0 complete; upto was step 0
        assert done is None
        nxt = await waiting  # worker 0 asked with upto=(0, 0) too: the round it waited for is through
        return sched, nxt

    sched, nxt = asyncio.run(scenario())
    assert nxt is None
    assert sched.round == 1 and sched.copies_issued == 2 and sched.portions_issued == 5


def test_scheduler_copies_slow_workers_portions_first_and_never_gives_them_copies():
    async def scenario():
        sched = PortionScheduler(portions=3, steps_per_epoch=4, start_step=4)  # resumed at epoch 1
        await sched.mark_slow([2])
        first = [await take(sched, w, upto=(1, 3)) for w in (2, 0, 1)]
        assert first[0].epoch == 1 and first[0].step == 0 and first[0].tag == 0
        copy = await take(sched, 0, finished=(0, 1), upto=(1, 3))
        assert copy.copy and copy.portion == first[0].portion  # the slow worker's portion, though not the oldest
        slow_waits = asyncio.create_task(take(sched, 2, finished=(0, 0), upto=(1, 3)))
        await asyncio.sleep(0.01)
        assert not slow_waits.done()  # flagged slow: no copy of portion 2 for it
        await take(sched, 1, finished=(0, 2), upto=(1, 0))  # round complete -> step 5 (epoch 1, step 1)
        return await slow_waits

    nxt = asyncio.run(scenario())
    assert (nxt.epoch, nxt.step, nxt.tag, nxt.copy) == (1, 1, 1, False)


def test_detector_flags_a_worker_much_slower_than_the_others_even_with_two_workers():
    d = StragglerDetector(workers=2, threshold=2.0, window=10, min_steps=3)
    d.add([0, 1] * 5, [0.01, 0.04] * 5)
    assert d.update(step=5) and set(d.flagged) == {1}
    assert d.flagged[1] == 4.0
    assert not d.update(step=6)  # unchanged verdict
    d.add([1] * 10, [0.011] * 10)  # worker 1 recovers: its recent window is normal again
    assert d.update(step=20) and d.flagged == {}
    assert d.summary() == {"1": {"first_detected_step": 5, "flagged_at_end": False, "pace_ratio": 1.1}}


def test_detector_leaves_a_uniformly_noisy_group_alone():
    rng = np.random.default_rng(0)
    d = StragglerDetector(workers=4, threshold=2.0)
    for _ in range(40):
        d.add(range(4), (0.01 * rng.uniform(0.7, 1.4, 4)).tolist())
    assert not d.update(step=40) and d.flagged == {}
