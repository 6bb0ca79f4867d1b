"""Straggler handling without Ray: k-of-n and portion rules in a shard, the portion scheduler, detection."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from distrain.orchestrator.stragglers import StragglerDetector
from distrain.strategies.portion_scheduler import PROBE_ROUNDS, Pace, PortionScheduler
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
    assert late.version == 1 and late.applied_version == -1 and late.lag == 1
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
        sched = PortionScheduler(per_round=3, steps_per_epoch=10, start_step=0)
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
        sched = PortionScheduler(per_round=3, steps_per_epoch=4, start_step=4)  # resumed at epoch 1
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


def drive(d: StragglerDetector, paces: list[list[float]], steps: int = 20) -> list[tuple[int, set[int]]]:
    """Feed the detector as the driver does: segment after segment, each worker's `steps` compute times
    (`paces[k][w]` seconds each in segment k) arriving on their own, a judgement after each.
    Returns the verdict changes as (global step, flagged workers)."""
    changes = []
    for k, segment in enumerate(paces):
        for worker, pace in enumerate(segment):
            d.add([worker] * steps, [pace] * steps)
            if d.update(step=(k + 1) * steps):
                changes.append(((k + 1) * steps, set(d.flagged)))
    return changes


def test_detector_flags_a_persistent_straggler_even_with_two_workers_and_releases_it_with_hysteresis():
    d = StragglerDetector(workers=2, threshold=2.0, window=10, min_steps=3)
    slow = [[0.01, 0.04]]  # worker 1: 4x and 30 ms per step slower
    assert drive(d, slow, steps=10) == []  # slow in one window: not yet
    assert drive(d, slow, steps=10) == [(10, {1})]  # slow in the next one too: flagged
    assert d.flagged[1] == 4.0
    assert drive(d, slow * 3, steps=10) == []  # unchanged verdict
    # Near the threshold (1.8x, 8 ms over) it stays flagged: released only when clearly fine
    assert drive(d, [[0.01, 0.018]] * 4, steps=10) == [] and set(d.flagged) == {1}
    assert drive(d, [[0.01, 0.011]], steps=10) == []  # fine for one window: still flagged
    assert drive(d, [[0.01, 0.011]], steps=10) == [(10, set())]  # fine over a window of its own: released
    assert d.summary() == {"1": {"first_detected_step": 10, "flagged_at_end": False, "pace_ratio": 1.1}}


def test_detector_ignores_a_one_off_slow_segment():
    """The default run's false alarm: one segment 2.1x slower ("stragglers: worker 0 (2.1x)", then
    "none now" two segments later). Even where the slowdown is large in milliseconds, one window of
    it is a burst of other load, not a straggler."""
    d = StragglerDetector(workers=2)
    paces = [[0.03, 0.03]] * 2 + [[0.063, 0.03]] + [[0.03, 0.03]] * 3  # worker 0: 2.1x, 33 ms over, once
    assert drive(d, paces) == [] and d.summary() == {}
    make_run = StragglerDetector(workers=2)  # cnn on digits: ~7 ms steps; 2.1x for three segments is 8 ms
    assert drive(make_run, [[0.007, 0.007]] + [[0.0147, 0.007]] * 3 + [[0.007, 0.007]]) == []
    assert make_run.summary() == {}


def test_detector_ignores_a_ratio_of_sub_millisecond_steps():
    """A 5-parameter model: steps of a fraction of a millisecond, where 2x is the scheduler's noise."""
    d = StragglerDetector(workers=3)
    assert drive(d, [[0.0003, 0.0007, 0.0003]] * 10) == []
    assert d.summary() == {} and d.ratios()[1] == pytest.approx(7 / 3)


def test_detector_leaves_a_uniformly_noisy_group_alone():
    rng = np.random.default_rng(0)
    d = StragglerDetector(workers=4, threshold=2.0)
    for _ in range(40):
        d.add(range(4), (0.01 * rng.uniform(0.7, 1.4, 4)).tolist())
    assert not d.update(step=40) and d.flagged == {}


def known(sched: PortionScheduler, paces: dict[int, float]) -> None:
    """Paces as if measured over enough chunks (seconds per portion)."""
    for worker, pace in paces.items():
        sched.pace.chunks[worker] = (Pace.MIN_CHUNKS, pace)


def test_scheduler_chunks_a_round_into_each_worker_s_share():
    async def scenario():
        sched = PortionScheduler(per_round=8, steps_per_epoch=10, start_step=0, workers=4)
        shares = [await take(sched, w) for w in (0, 1, 2, 3)]
        # Without a straggler, plain BSP's work: the round is four chunks, one each.
        assert [(a.portion, a.count, a.copy) for a in shares] == [
            (0, 2, False),
            (2, 2, False),
            (4, 2, False),
            (6, 2, False),
        ]
        assert sched.stats()["chunks_issued"] == 4 and sched.portions_issued == 8
        return sched

    async def with_one_slow():
        sched = PortionScheduler(per_round=8, steps_per_epoch=10, start_step=0, workers=4)
        known(sched, {0: 0.01, 1: 0.08, 2: 0.01, 3: 0.01})  # worker 1: 8x the others a portion
        sched.shared[1] = 0  # measured by a copy this round already (no probe due)
        first = [await take(sched, w, upto=(0, 9)) for w in (0, 2)]
        waits = asyncio.create_task(take(sched, 1, upto=(0, 9)))
        last = await take(sched, 3, upto=(0, 9))
        await asyncio.sleep(0.01)
        assert not waits.done()  # measured slow: no share, its work would only be copied
        assert [(a.portion, a.count) for a in (*first, last)] == [(0, 3), (3, 3), (6, 2)]
        waits.cancel()
        return sched

    asyncio.run(scenario())
    asyncio.run(with_one_slow())


def test_a_worker_measured_slow_gets_a_copy_to_measure_it_by_every_probe_rounds():
    sched = PortionScheduler(per_round=4, steps_per_epoch=100, start_step=0, workers=2)
    known(sched, {0: 0.01, 1: 0.1})
    sched.shared[1] = 0
    for r in range(1, PROBE_ROUNDS + 1):
        sched.round = r
        sched._open_round()
        assert sched._take(1) is None, r  # no share: the fast worker takes the round whole
        assert sched._take(0) == (0, 4, False)
        got = sched._take(1)
        assert (got is not None) == (r == PROBE_ROUNDS), r
    assert got == (0, 4, True)  # the probe: a copy of the chunk running elsewhere, off the critical path
    assert sched._take(1) is None  # once per PROBE_ROUNDS


def test_a_copy_is_refused_only_where_the_holder_is_expected_to_finish_first():
    pace = Pace()
    for _ in range(Pace.MIN_CHUNKS):
        pace.add(0, 0.02, 2)  # 10 ms a portion
        pace.add(1, 0.02, 2)
        pace.add(2, 0.4, 2)  # 200 ms a portion
    assert pace.slow() == {2}
    now = 100.0
    # A fast holder 5 ms into its 2-portion chunk ends at 115 ms; a copy now would end at 120 ms: refused.
    assert not pace.pays(0, 1, now - 0.005, 2, now)
    # The slow holder is expected at +395 ms: a copy pays.
    assert pace.pays(0, 2, now - 0.005, 2, now)
    # A holder overdue (planned end 30 ms ago) is expected as late again: a copy pays.
    assert pace.pays(0, 1, now - 0.05, 2, now)
    assert pace.pays(0, 3, now, 2, now)  # a pace not measured yet: MapReduce's rule (copy)
    one = Pace()
    one.add(0, 0.02, 1)
    one.add(1, 1.0, 1)
    assert one.slow() == set() and one.per_portion == {}  # one chunk each: not known yet


def test_a_chunk_counts_its_portions_in_the_round_mean_and_chunks_never_overlap():
    async def scenario():
        s = ParameterShard(0, 2, ConsistencyRule.backup_tasks(4), SGD, g(0.0))
        kept = [await s.push_portion(0, 0, 0, g(2.0), 1.0, 3)]  # portions 0-2: their mean gradient is 2
        with pytest.raises(RuntimeError, match="overlaps"):
            await s.push_portion(1, 0, 2, g(5.0), 1.0, 2)
        kept.append(await s.push_portion(1, 0, 0, g(7.0), 1.0, 3))  # the chunk's copy: dropped, 3 portions
        kept.append(await s.push_portion(1, 0, 3, g(6.0), 1.0))  # the last portion closes the round
        return s, kept

    s, kept = asyncio.run(scenario())
    assert kept == [True, False, True]
    np.testing.assert_allclose(s.theta, [-3.0])  # (3 x 2 + 6) / 4 applied once
    assert s.round_members == [[0, 1, 2, 3]] and s.dropped == [0, 3]


def test_a_pace_is_known_from_a_workers_second_chunk_and_weighs_the_newest_half():
    pace = Pace()
    pace.add(0, 0.4, 2)  # 0.2 s a portion: a first chunk (it may hold one-off costs) is not a pace yet
    assert pace.per_portion == {}
    pace.add(0, 0.2, 2)  # 0.1 s a portion
    assert pace.per_portion == {0: pytest.approx(0.15)}
    pace.add(0, 0.1, 1)
    assert pace.per_portion == {0: pytest.approx(0.125)}
    pace.forget(0)  # a worker that left: measured afresh if it comes back
    pace.add(0, 0.1, 1)
    assert pace.per_portion == {}
