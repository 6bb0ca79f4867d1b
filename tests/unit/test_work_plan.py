"""Work plans, pure logic: who trains on which (epoch, step, slice)."""

from __future__ import annotations

from collections import Counter

from distrain.orchestrator.work import WorkPlan


def drain(plan: WorkPlan, order: list[int]) -> dict[int, list]:
    """Ask workers for segments in the given repeating order until no work is left."""
    taken: dict[int, list] = {w: [] for w in set(order)}
    idle = 0
    while idle < len(order):
        idle = 0
        for w in order:
            seg = plan.next_segment(w)
            if seg:
                taken[w].extend(seg)
                plan.complete(seg)
            else:
                idle += 1
    return taken


def test_static_plan_gives_worker_r_slice_r_of_every_step_without_crossing_epochs():
    plan = WorkPlan(total_steps=50, steps_per_epoch=22, workers=3, segment_steps=10, shared=False)
    seg = plan.next_segment(1)
    assert seg == [(0, s, 1) for s in range(10)]
    plan.complete(seg)
    taken = drain(plan, [0, 1, 2])
    assert [u[1] for u in taken[0] if u[0] == 0][-1] == 21 and (1, 0, 0) in taken[0]  # stops at the epoch end
    for w in range(3):
        assert all(unit[2] == w for unit in taken[w])
    assert plan.finished and plan.steps_done == 50


def test_shared_plan_covers_every_unit_once_and_splits_each_epoch_among_workers():
    plan = WorkPlan(total_steps=44, steps_per_epoch=22, workers=2, segment_steps=50, shared=True)
    first, second = plan.next_segment(0), plan.next_segment(1)
    assert {u[0] for u in first} == {u[0] for u in second} == {0}  # both workers share epoch 0
    plan.complete(first)
    assert plan.complete(second) == [0]  # epoch 0 is complete once both segments are done
    rest = drain(plan, [0, 1, 1, 1])  # worker 1 asks three times as often (worker 0 is slow)
    units = first + second + rest[0] + rest[1]
    assert Counter(units).most_common(1)[0][1] == 1 and len(units) == 44 * 2
    assert plan.finished


def test_resumed_plan_starts_at_the_checkpoint_step():
    plan = WorkPlan(total_steps=30, steps_per_epoch=22, workers=2, segment_steps=50, shared=False, start_step=20)
    assert plan.next_segment(0) == [(0, 20, 0), (0, 21, 0)]
    assert plan.units_in_epoch(0) == 4 and plan.units_in_epoch(1) == 16


def test_shared_plan_hands_a_lost_workers_units_out_again_first_and_each_unit_completes_once():
    plan = WorkPlan(total_steps=20, steps_per_epoch=10, workers=2, segment_steps=4, shared=True)
    lost = plan.next_segment(1)  # worker 1 dies with this segment: none of it completed
    plan.requeue(lost)
    again = plan.next_segment(0)
    assert again == lost  # handed out before any new unit
    plan.complete(again)
    rest = drain(plan, [0, 1])
    units = again + rest[0] + rest[1]
    assert Counter(units).most_common(1)[0][1] == 1 and len(units) == 20 * 2
    assert plan.finished and plan.steps_done == 20


def test_no_unit_at_or_past_the_hold_is_handed_out_until_it_moves():
    """A --chaos step: segments end at it (static and shared), nobody gets work past it, and a worker
    that waits there is `held`, not out of work; once the hold moves on, the rest is handed out."""
    for shared in (False, True):
        plan = WorkPlan(total_steps=22, steps_per_epoch=22, workers=2, segment_steps=20, shared=shared)
        plan.hold = 7
        taken = drain(plan, [0, 1])
        units = taken[0] + taken[1]
        assert max(u[1] for u in units) == 6 and len(units) == 7 * 2, shared
        assert plan.steps_done == 7 and plan.held(0) and plan.held(1) and not plan.finished
        plan.hold = None
        rest = drain(plan, [0, 1])
        assert min(u[1] for u in rest[0] + rest[1]) == 7
        assert plan.finished and not plan.held(0)
    plan = WorkPlan(total_steps=22, steps_per_epoch=22, workers=2, segment_steps=20, shared=False)
    plan.hold = 30  # past the end: it holds nothing back
    assert len(plan.next_segment(0)) == 20 and not plan.held(0)
