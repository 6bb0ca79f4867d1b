"""Elastic BSP over the collective (issue 18), without Ray: how the remaining units of an epoch are
dealt out in lock-step rounds as the membership changes (orchestrator/rounds.py), and the rate a round
is applied at under each --lr-scaling rule (strategies/elastic_group.py)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from distrain.orchestrator.rounds import PLACEHOLDER, RoundPlan, real_units
from distrain.strategies.elastic_group import lr_factor


def _run(plan: RoundPlan, memberships: list[list[int]], rounds: int) -> list[dict[int, list]]:
    """Deal blocks with each membership in turn (the last repeated) until the plan is done."""
    blocks, i = [], 0
    while not plan.finished:
        members = memberships[min(i, len(memberships) - 1)]
        block = plan.deal(members, rounds)
        assert block, "stalled"
        assert len({len(units) for units in block.values()}) == 1  # lock-step: every member the same rounds
        finished = []
        for units in block.values():
            finished += plan.complete(real_units(units))
            assert len({u[0] for u in units}) == 1  # a block never crosses an epoch
        short = any(u[2] == PLACEHOLDER for units in block.values() for u in units)
        assert not short or finished  # a member sits a round out only where the epoch's units ran out
        blocks.append(block)
        i += 1
    return blocks


def test_every_unit_dealt_exactly_once_across_membership_changes():
    spe, slots = 5, 3
    plan = RoundPlan(total_steps=10, steps_per_epoch=spe, slots=slots)
    blocks = _run(plan, [[0], [0, 2], [0, 1, 2], [0, 1], [1]], rounds=2)
    dealt = [u for b in blocks for units in b.values() for u in real_units(units)]
    assert len(dealt) == len(set(dealt)) == 10 * slots
    assert Counter(u[0] for u in dealt) == {0: spe * slots, 1: spe * slots}
    # With two members a round takes two units: the update's batch is 2 x B (one unit each, in order).
    assert blocks[1] == {0: [(0, 0, 2), (0, 1, 1)], 2: [(0, 1, 0), (0, 1, 2)]}
    # A round the units ran out in (the epoch's end) has a placeholder for the member left without one.
    placeholders = [u for b in blocks for units in b.values() for u in units if u[2] == PLACEHOLDER]
    assert placeholders
    assert plan.steps_done == 10


def test_an_abandoned_round_is_dealt_again_first_and_cuts_stop_blocks():
    plan = RoundPlan(total_steps=6, steps_per_epoch=6, slots=2, cut_every=3)
    first = plan.deal([0, 1], rounds=2)
    assert first == {0: [(0, 0, 0), (0, 1, 0)], 1: [(0, 0, 1), (0, 1, 1)]}
    plan.complete([(0, 0, 0), (0, 0, 1)])  # round 0 stood; round 1 was abandoned (a peer lost)
    plan.requeue([(0, 1, 0), (0, 1, 1)])
    assert not plan.aligned
    assert plan.deal([0], rounds=4) == {0: [(0, 1, 0), (0, 1, 1)]}  # the survivor redoes them alone
    plan.complete([(0, 1, 0), (0, 1, 1)])
    assert plan.aligned and plan.steps_done == 2
    # A checkpoint every 3 steps: the block ends at step 3's boundary, a placeholder filling the round.
    assert plan.deal([0, 1, 2][:2], rounds=5) == {0: [(0, 2, 0)], 1: [(0, 2, 1)]}
    plan.complete([(0, 2, 0), (0, 2, 1)])
    assert plan.steps_done == 3 and plan.aligned
    odd = plan.deal([0, 1, 2], rounds=1, to_step_boundary=False)
    assert odd == {0: [(0, 3, 0)], 1: [(0, 3, 1)], 2: [(0, 4, 0)]}
    plan.complete(real_units([u for units in odd.values() for u in units]))
    assert not plan.aligned  # mid-step: a drain's checkpoint waits for the boundary
    tail = plan.deal([0, 1, 2], rounds=3, to_step_boundary=True)
    assert tail == {0: [(0, 4, 1)], 1: [(0, 4, PLACEHOLDER)], 2: [(0, 4, PLACEHOLDER)]} and plan.aligned


@pytest.mark.parametrize(
    "rule, units, expected",
    [("linear", 3, 1.0), ("linear", 2, 2 / 3), ("linear", 1, 1 / 3), ("sqrt", 1, math.sqrt(1 / 3)), ("none", 1, 1.0)],
)
def test_the_rate_follows_the_rounds_global_batch(rule, units, expected):
    # MAX = 3 slots of B = 16: the schedule's rate is set for 48 samples; a round of `units` x 16 scales it.
    assert lr_factor(units, 3, 16, 64, rule) == pytest.approx(expected)


def test_tensor_parallel_mates_take_each_unit_together_and_every_unit_is_dealt_once():
    """--tensor-parallel 2 under a range (strategies/elastic_sharded_bsp.py): ranks 2i and 2i + 1 are one
    data-parallel rank, dealt the same units (placeholders included); MAX x 1 slices a step among the pairs."""
    plan = RoundPlan(total_steps=6, steps_per_epoch=3, slots=3, share=2)
    blocks, memberships = [], [[0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 4, 5]]
    while not plan.finished:
        members = memberships[min(len(blocks), 2)]
        block = plan.deal(members, rounds=2)
        for lead in members[::2]:
            assert block[lead] == block[lead + 1]
        plan.complete([u for lead in members[::2] for u in real_units(block[lead])])
        blocks.append(block)
    dealt = [u for b in blocks for lead, units in b.items() if lead % 2 == 0 for u in real_units(units)]
    assert len(dealt) == len(set(dealt)) == 6 * 3
    assert blocks[0][0] == [(0, 0, 0), (0, 0, 2)] and blocks[0][2] == [(0, 0, 1), (0, 1, 0)]
    with pytest.raises(ValueError, match="not whole groups of 2"):
        plan.deal([0, 1, 2], rounds=1)
