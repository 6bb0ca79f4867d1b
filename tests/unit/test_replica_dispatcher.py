"""The dispatcher of a range across cut replicas over the PS (orchestrator/replica_dispatcher.py), with a
fake submit (no Ray): a replica's segment reaches its D workers (worker d: slice s x D + d), its rows
count once all D are back, and a replica lost mid-segment hands its units out again without a row of
them having been recorded, so every (epoch, step, slice) ends with exactly one row."""

from __future__ import annotations

from collections import Counter

from distrain.orchestrator.replica_dispatcher import ReplicaDispatcher
from distrain.orchestrator.work import WorkPlan

D, MAX, STEPS, SPE = 2, 3, 4, 4


def dispatcher() -> tuple[ReplicaDispatcher, list]:
    calls: list = []

    def submit(kind, rank, payload):
        calls.append((kind, rank, payload))
        return len(calls) - 1

    plan = WorkPlan(STEPS, SPE, MAX, segment_steps=2, shared=True)
    dispatch = ReplicaDispatcher(plan, submit, D)
    dispatch.elastic = True
    return dispatch, calls


def answer(dispatch: ReplicaDispatcher, handle, rows: Counter) -> None:
    """The loop's part for one result: held back until the replica's D are in, then recorded and fed."""
    kind, rank, units = dispatch.done(handle)
    if kind != "segment":  # the last epoch's evaluation
        return
    result = {"slice": [u[2] for u in units], "step": [u[1] for u in units], "loss": [0.0] * len(units)}
    if dispatch.collect(rank, units, result):
        return
    rows.update(zip(result["step"], result["slice"], strict=True))
    dispatch.completed(rank, units)
    dispatch.feed(rank)


def finish_without_replica_1(dispatch: ReplicaDispatcher, redo: list, rows: Counter) -> None:
    """Replica 1 (workers 2, 3) gone: its units go out again to the others, and the run ends with every
    (step, slice) recorded exactly once."""
    dispatch.work.requeue(redo)
    dispatch.members = [0, 1, 4, 5]
    while dispatch.pending:
        answer(dispatch, next(iter(dispatch.pending)), rows)
    assert dispatch.work.finished
    assert set(rows) == {(step, s) for step in range(STEPS) for s in range(MAX * D)}
    assert set(rows.values()) == {1}


def test_a_replica_segment_goes_to_its_workers_and_counts_once_all_are_back():
    dispatch, calls = dispatcher()
    dispatch.feed_all()
    segments = [(r, u) for k, r, u in calls if k == "segment"]
    assert [r for r, _ in segments] == [0, 1, 2, 3, 4, 5]  # every replica's D workers, fed through worker 0
    assert segments[0][1] == [(0, 0, 0), (0, 0, 2)] and segments[1][1] == [(0, 0, 1), (0, 0, 3)]
    assert segments[5][1] == [(0, 1, 3), (0, 1, 5)]  # replica 2, worker 1: slices 2 x 2 + 1 of 6
    rows: Counter = Counter()
    answer(dispatch, 0, rows)  # replica 0's worker 0 alone: nothing recorded, nothing counted
    assert not rows and dispatch.work.units_done[0] == 0 and dispatch.in_flight(0) == 0
    answer(dispatch, 1, rows)
    assert sorted(rows) == [(0, 0), (0, 1), (0, 2), (0, 3)] and dispatch.work.units_done[0] == 2
    assert [u for k, r, u in calls[6:] if r == 0] == [[(0, 2, 0), (0, 2, 2)]]  # fed the next units


def test_a_replica_lost_mid_segment_hands_its_units_out_again_and_each_slice_keeps_one_row():
    dispatch, calls = dispatcher()
    dispatch.feed_all()
    rows: Counter = Counter()
    answer(dispatch, 2, rows)  # replica 1's worker 0 is back; its worker 1 is then lost
    lost_calls, redo = dispatch.take_replica(3)
    assert redo == [(0, 0, 2), (0, 1, 0)] and {r for _, (_, r, _) in lost_calls} == {3}
    assert not dispatch.parts  # the held-back result is dropped, unrecorded
    finish_without_replica_1(dispatch, redo, rows)
    assert all(r not in (2, 3) for k, r, _ in calls[6:])
    assert [(k, r) for k, r, _ in calls if k == "eval"] == [("eval", 0)]  # once, on the first replica


def test_a_segment_back_broken_is_handed_out_again_with_its_replica_and_each_slice_keeps_one_row():
    """Replica 1's worker 0 returns its first segment broken (its FSDP collective failed: worker 1 gone,
    its call's failure not yet read): the broken rows are dropped (`abandon`), and when the replica leaves,
    those units go out again with the rest of its segments even once its worker 1's call is taken away."""
    dispatch, calls = dispatcher()
    dispatch.feed_all()
    rows: Counter = Counter()
    kind, rank, units = dispatch.done(2)  # replica 1's worker 0: back broken, not collected
    dispatch.abandon(rank, units)
    dispatch.done(3)  # its worker 1's call: gone with it (read as lost elsewhere)
    lost_calls, redo = dispatch.take_replica(3)
    assert redo == [(0, 0, 2), (0, 1, 0)] and not lost_calls and not dispatch.abandoned
    finish_without_replica_1(dispatch, redo, rows)


def test_a_tensor_parallel_replica_deals_a_data_parallel_rank_s_slice_to_its_t_workers_together():
    """D x T = 2 x 2: worker (d, t) (rank d x T + t of its replica) takes slice s x D + d, its T workers
    alike, and the replica's 4 results count its units once; under a hybrid plan (4 data-parallel ranks)
    each of the 4 workers its own slice s x 4 + w."""
    for ranks, expected in ((2, [[0, 2], [0, 2], [1, 3], [1, 3]]), (4, [[0, 4], [1, 5], [2, 6], [3, 7]])):
        calls: list = []

        def submit(kind, rank, payload, calls=calls):
            calls.append((kind, rank, payload))
            return len(calls) - 1

        dispatch = ReplicaDispatcher(WorkPlan(STEPS, SPE, MAX, segment_steps=2, shared=True), submit, 4, ranks)
        dispatch.elastic = True
        dispatch.feed_all()
        segments = [(r, u) for k, r, u in calls if k == "segment"]
        assert [r for r, _ in segments[:4]] == [0, 1, 2, 3]
        assert [[sl for _, _, sl in u] for _, u in segments[:4]] == expected
        rows: Counter = Counter()
        for handle in range(3):
            answer(dispatch, handle, rows)
        assert not rows and dispatch.work.units_done[0] == 0  # held back until the replica's 4 are in
        answer(dispatch, 3, rows)
        assert dispatch.work.units_done[0] == 2 and sum(rows.values()) == 4 * 2
