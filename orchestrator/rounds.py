"""Elastic BSP over the collective transport: a shared work plan dealt out in lock-step rounds.

The books are the shared `WorkPlan`'s (orchestrator/work.py) for MAX slots: a step is MAX slices of
B samples, units are taken in order (step-major, slice-minor) and a lost round's units go back to be
taken first. What this adds is the deal: members train in lock-step (each round is one all-reduce),
so a block of `rounds` rounds gives each member one unit per round, and every member gets the same
number of rounds. With N members a round takes the next N units, so the update's batch is N x B and
the epoch's remaining units are re-divided among whoever is there; every unit is dealt exactly once
(again only if its round was abandoned). Where the units run out before a round is full (the end of
an epoch, of the run, or a cut), a member sits the round out with a placeholder (slice -1, see
strategies/local_sgd.py ElasticLocalSGD): blocks never cross an epoch (an evaluation reads the model at its end)
nor a cut (a checkpoint, or a step boundary a draining node waits for).
"""

from __future__ import annotations

from distrain.orchestrator.work import Unit, WorkPlan

PLACEHOLDER = -1  # the slice of a unit that is no unit: the member sits the round out


class RoundPlan(WorkPlan):
    def __init__(
        self,
        total_steps: int,
        steps_per_epoch: int,
        slots: int,
        start_step: int = 0,
        cut_every: int = 0,
        share: int = 1,
    ):
        super().__init__(total_steps, steps_per_epoch, slots, 1, True, start_step, cut_every)
        # Consecutive members that take one unit together: a cut replica's data-parallel rank's T
        # tensor-parallel workers (strategies/elastic_sharded_bsp.py); members come and go `share` at a time.
        self.share = share

    @property
    def aligned(self) -> bool:
        """At a step boundary: every unit of the steps before the cursor is done or dealt, none after."""
        return not self.returned and self.shared_cursor % self.workers == 0

    def deal(self, members: list[int], rounds: int, to_step_boundary: bool = False) -> dict[int, list[Unit]]:
        """The next block: `rounds` rounds (fewer where the units run out first) for `members`, each a
        list of one unit per round, placeholders included. Empty when there is nothing to deal.
        `to_step_boundary`: the block ends at the end of a step (a checkpoint is to be taken there)."""
        k = self.share
        if len(members) % k:
            raise ValueError(f"members {members} are not whole groups of {k}")
        leads = members[::k]  # each takes the units; the k - 1 after it take the same
        n = len(leads)
        if self.returned:  # a lost block's units first, all of one epoch (blocks never cross one)
            epoch = self.returned[0][0]
            take = [u for u in self.returned if u[0] == epoch][: rounds * n]
            for unit in take:
                self.returned.remove(unit)
        else:
            slots, spe = self.workers, self.steps_per_epoch
            first = self.shared_cursor
            stop = min(self.total_steps * slots, (first // slots // spe + 1) * spe * slots, first + rounds * n)
            if self.cut_every:
                stop = min(stop, (first // slots // self.cut_every + 1) * self.cut_every * slots)
            if to_step_boundary and first % slots:
                stop = min(stop, (first // slots + 1) * slots)
            if self.hold is not None:
                stop = min(stop, self.hold * slots)
            take = [self._unit(u // slots, u % slots) for u in range(first, max(first, stop))]
            self.shared_cursor = max(first, stop)
        if not take:
            return {}
        block: dict[int, list[Unit]] = {rank: [] for rank in leads}
        for r in range(-(-len(take) // n)):
            units = take[r * n : (r + 1) * n]
            for i, rank in enumerate(leads):
                # A placeholder sits at the round's first unit's step (its rate is not used: weight 0).
                block[rank].append(units[i] if i < len(units) else (units[0][0], units[0][1], PLACEHOLDER))
        if k == 1:
            return block
        return {rank: list(block[members[i - i % k]]) for i, rank in enumerate(members)}


def real_units(units: list[Unit]) -> list[Unit]:
    """A block's units without the placeholders."""
    return [u for u in units if u[2] != PLACEHOLDER]


class StepRoundPlan(RoundPlan):
    """Elastic BSP with unequal shares (--balance speed under a range; orchestrator/elastic_balance.py): a
    round is one whole step of the configured global batch, cut among the members by their shares. The
    books count steps (a `RoundPlan` of one slot a step); the deal gives every member the step's unit
    (epoch, step, its slot), whose samples are its slot's block of the step under the shares the driver
    sends with the segment. So a step's samples are covered once whoever the members are, and no member
    ever sits a round out (each share is >= 1)."""

    def __init__(
        self, total_steps: int, steps_per_epoch: int, start_step: int = 0, cut_every: int = 0, per_unit: int = 1
    ):
        super().__init__(total_steps, steps_per_epoch, 1, start_step, cut_every)
        self.steps_completed: set[tuple[int, int]] = set()
        # Actors that read one slice together: a cut replica's data-parallel rank's T tensor-parallel
        # workers (1 under a hybrid plan, and for plain workers), so actor a reads slice a // per_unit.
        self.per_unit = per_unit

    def deal(self, members: list[int], rounds: int, to_step_boundary: bool = False) -> dict[int, list[Unit]]:
        """Every member the step's unit at its own slice: a plain member's slot, a cut replica's worker its
        data-parallel rank's (slot x D + d: part d of its replica's share, `share_cut`)."""
        steps = super().deal([-1], rounds, to_step_boundary).get(-1, [])
        if not steps:
            return {}
        return {rank: [(epoch, step, rank // self.per_unit) for epoch, step, _ in steps] for rank in members}

    def requeue(self, units: list[Unit]) -> None:
        """An abandoned round's units (one per member): its step, once, to be dealt again first."""
        again = list(dict.fromkeys((epoch, step, 0) for epoch, step, _ in units))
        super().requeue([u for u in again if u not in self.returned])

    def complete(self, units: list[Unit]) -> list[int]:
        """A step is done once, whichever of its members' units says so first (all stood together)."""
        new = [(e, s, 0) for e, s, _ in units if (e, s) not in self.steps_completed]
        self.steps_completed |= {(e, s) for e, s, _ in new}
        return super().complete(list(dict.fromkeys(new)))
