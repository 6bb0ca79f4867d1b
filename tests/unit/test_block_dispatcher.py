"""The work source of lock-step blocks (orchestrator/block_dispatcher.py), without Ray: a block goes to
every member once the scaling policy had its turn, the next only once it is whole; its books (rounds
that stand, redo, units without a row, the source); the boundary's evaluation and checkpoints."""

from __future__ import annotations

import itertools
from typing import Any

from distrain.orchestrator.block_dispatcher import BlockDispatcher
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.rounds import PLACEHOLDER, RoundPlan


class Calls:
    """A `submit` that books each call and answers with a fresh handle."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.made: list[tuple[str, int, Any]] = []

    def __call__(self, kind: str, rank: int, payload: Any) -> int:
        self.made.append((kind, rank, payload))
        return next(self.ids)


def dispatcher(total: int = 8, spe: int = 4, slots: int = 3, rounds: int = 2, **books: int):
    calls = Calls()
    d = BlockDispatcher(RoundPlan(total, spe, slots), calls, rounds, **books)
    d.members = [0, 1]
    return d, calls


def rows(units: list, broken_after: int | None = None) -> dict[str, list]:
    """A member's segment result: one row per real unit, `broken` if its group broke after that many rounds."""
    result: dict[str, list] = {"step": [], "slice": [], "loss": []}
    for epoch, step, slice_ in units:
        if slice_ != PLACEHOLDER:
            result["step"].append(epoch * 4 + step)
            result["slice"].append(slice_)
            result["loss"].append(1.0)
    if broken_after is not None:
        result["broken"] = [{"rounds": broken_after}]
    return result


def answer(d: BlockDispatcher, broken: dict[int, int] | None = None) -> None:
    """Every member of the block out now answers (`broken`: rank -> the rounds it completed)."""
    for handle, (kind, rank, units) in list(d.pending.items()):
        if kind == "segment":
            d.done(handle)
            assert d.collect(rank, units, rows(units, (broken or {}).get(rank)))


def test_a_block_goes_to_every_member_after_the_policys_turn_and_the_next_only_once_it_is_whole():
    d, calls = dispatcher()
    d.feed_all()
    assert calls.made == []  # the scaling policy has not had its turn at this boundary
    d.turn_taken = True
    d.feed_all()
    # 2 rounds of one unit per member: units in order (step-major, slice-minor) over 3 slots
    assert calls.made == [("segment", 0, [(0, 0, 0), (0, 0, 2)]), ("segment", 1, [(0, 0, 1), (0, 1, 0)])]
    d.feed(0)
    d.feed_all()
    assert len(calls.made) == 2  # the block is out: nothing more, for anyone
    answer(d)
    assert d.back() and d.work.steps_done == 0  # held back: nothing is done before the block's books
    end = d.close()
    assert (end.finished, end.redo, end.lost, end.source) == ([], [], {}, 0)
    assert end.rows[0]["step"] == [0, 0] and d.work.units_done[0] == 4
    d.feed_all()
    assert len(calls.made) == 2  # the next block waits for the policy's next turn
    d.turn_taken = True
    d.feed_all()
    assert [c[2] for c in calls.made[2:]] == [[(0, 1, 1), (0, 2, 0)], [(0, 1, 2), (0, 2, 1)]]


def test_a_broken_block_keeps_the_rounds_every_survivor_completed_and_redoes_the_rest():
    d, calls = dispatcher()
    d.members = [0, 1, 2]
    d.turn_taken = True
    d.feed_all()
    block = {rank: units for _, rank, units in calls.made}
    lost = RunLost("worker", None, "ActorDiedError")  # a peer's failure names no rank: the caller's
    assert d.defer(lost, 1) and 1 not in {r for _, r, _ in d.pending.values()}
    assert not d.defer(RunLost("worker", 5, "x"), 5)  # not a member of the block
    assert not d.back()
    handles = {r: h for h, (_, r, _) in d.pending.items()}
    d.done(handles[0])
    d.collect(0, block[0], rows(block[0], broken_after=1))
    d.done(handles[2])
    d.collect(2, block[2], rows(block[2]))  # it completed both rounds: the second stands for nobody
    assert d.back()
    end = d.close()
    assert end.rows[0]["step"] == end.rows[2]["step"] == [0] and "broken" not in end.rows[0]
    assert end.redo == [block[0][1], block[1][1], block[2][1]]  # the abandoned round's units
    assert end.without_row == {1: [block[1][0]]}  # applied in the round that stands, its row died with it
    assert end.lost == {1: lost} and end.source == 0  # a survivor at the round that stands
    assert d.work.units_done[0] == 3 and d.work.returned == end.redo
    assert (d.block, d.results, d.lost, d.turn_taken) == ({}, {}, {}, False)


def test_the_boundary_evaluates_the_epoch_and_checkpoints_on_the_first_member_only_at_a_step_boundary():
    d, calls = dispatcher(total=8, spe=2, slots=2, rounds=2, eval_every=1, checkpoint_every=1, checkpoint_steps=2)
    d.members = [1, 0]
    d.turn_taken = True
    d.feed_all()  # 2 rounds of 2 members: steps 0 and 1, epoch 0 whole
    answer(d)
    end = d.close()
    d.at_boundary(end.finished)
    assert calls.made[2:] == [("eval", 1, 0), ("state", 1, ("step-00000002.pt", 2)), ("state", 1, ("epoch-0001.pt", 2))]
    assert d.checkpoints_outstanding() == {2} and d.evals_outstanding() == {0}


def test_the_boundary_queues_the_schedules_checkpoints_once_per_step_and_never_the_final_one():
    # 4 steps of 2 slots, every step checkpointed; epochs of 2 steps, each checkpointed
    d, calls = dispatcher(total=4, spe=2, slots=2, rounds=1, checkpoint_every=1, checkpoint_steps=1)
    d.turn_taken = True
    d.feed_all()
    answer(d)
    d.at_boundary(d.close().finished)  # step 1: its step checkpoint
    assert [c for c in calls.made if c[0] == "state"] == [("state", 0, ("step-00000001.pt", 1))]
    d.at_boundary([])  # the same step again (a block abandoned whole moves none): nothing more
    assert len([c for c in calls.made if c[0] == "state"]) == 1
    for handle in [h for h, c in d.pending.items() if c[0] == "state"]:
        d.done(handle)
    for _ in range(3):  # steps 2, 3 and 4 (the run's end: its epoch checkpoint, the final one is the controller's)
        d.turn_taken = True
        d.feed_all()
        answer(d)
        d.at_boundary(d.close().finished)
        for handle in [h for h, c in d.pending.items() if c[0] != "segment"]:
            d.done(handle)
    states = [payload for kind, _, payload in calls.made if kind == "state"]
    assert states == [
        ("step-00000001.pt", 1), ("step-00000002.pt", 2), ("epoch-0001.pt", 2), ("step-00000003.pt", 3),
        ("epoch-0002.pt", 4),
    ]  # fmt: skip


def test_the_chaos_hold_is_reached_only_at_a_boundary_after_the_policys_turn():
    d, _ = dispatcher(total=8, spe=4, slots=2, rounds=4)
    d.work.hold = 2
    d.turn_taken = True
    d.feed_all()  # the block stops at the hold: steps 0 and 1
    assert all(len(units) == 2 for _, _, units in d.pending.values())
    assert not d.reached_hold()
    answer(d)
    d.close()
    assert d.work.steps_done == 2 and not d.reached_hold()  # the policy's turn first
    d.turn_taken = True
    assert d.reached_hold()
    d.lift_hold(None)
    assert not d.reached_hold() and len(d.pending) == 2  # the next block went out


def test_units_taken_by_tensor_parallel_mates_are_completed_and_redone_once():
    """RoundPlan(share=2): ranks (0, 1) and (2, 3) each take one unit a round together; a broken block's
    books count each unit once although both mates list it."""
    calls = Calls()
    d = BlockDispatcher(RoundPlan(8, 4, 3, share=2), calls, 2)
    d.members, d.turn_taken = [0, 1, 2, 3], True
    d.feed_all()
    block = {rank: units for _, rank, units in calls.made}
    assert block[0] == block[1] == [(0, 0, 0), (0, 0, 2)] and block[2] == block[3] == [(0, 0, 1), (0, 1, 0)]
    for handle, (_, rank, units) in list(d.pending.items()):
        d.done(handle)
        d.collect(rank, units, rows(units, broken_after=1))  # every member completed round 1 only
    end = d.close()
    assert end.redo == [(0, 0, 2), (0, 1, 0)] and d.work.units_done[0] == 2 and d.work.returned == end.redo
