"""The work source of an elastic phase over the collective transport: lock-step blocks, behind the
`Dispatcher`'s interface (orchestrator/dispatcher.py), so the controller's one phase loop
(orchestrator/controller/loop.py) runs them as it runs every other plan.

Members of a collective group train in lock-step and change only at a boundary all of them share
(orchestrator/controller/collective_scaling.py), so this source deals a *block* (orchestrator/rounds.py's
`RoundPlan`: the next rounds, one unit per member per round) to every member as pending "segment" calls,
and deals the next one only when the whole block is back and the scaling policy has had its turn at the
boundary (`turn_taken`). The block's results are held back (`collect`) and a member lost in it is set
aside (`defer`) until the block is whole: only then is it known which rounds stand (`close`). At the
boundary the epoch's evaluation and the checkpoints due go out as ordinary "eval" / "state" calls on one
member (all hold the same state), which the loop records as for any plan.

It calls nothing itself: calls go through `submit`, the group re-forms through `before_deal`, so it is
tested without Ray (tests/unit/test_block_dispatcher.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distrain.orchestrator.checkpoint_schedule import FINAL
from distrain.orchestrator.dispatcher import Dispatcher, Submit, evaluates
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.rounds import RoundPlan, real_units
from distrain.orchestrator.work import Unit


@dataclass
class BlockEnd:
    """A block all of whose members answered (or were lost): what stands of it."""

    epoch: int  # of its first unit (blocks never cross an epoch)
    rows: dict[int, dict[str, list[Any]]]  # each survivor's rows of the rounds that stand
    finished: list[int]  # epochs it completed
    redo: list[Unit]  # units of abandoned rounds, back in the plan
    without_row: dict[int, list[Unit]]  # each lost member's units applied in rounds that stand
    lost: dict[int, RunLost] = field(default_factory=dict)
    source: int | None = None  # a survivor at the last round that stands (whose state the others take)


class BlockDispatcher(Dispatcher):
    def __init__(self, plan: RoundPlan, submit: Submit, rounds: int, **books: int) -> None:
        """`books`: the `Dispatcher`'s --eval-every, --checkpoint-every and --checkpoint-steps."""
        super().__init__(plan, submit, **books)
        self.work: RoundPlan = plan
        self.rounds = rounds  # BSP: --segment-steps; local SGD: τ (a block ends in its average)
        self.elastic = True  # one member scores the whole test set and takes the checkpoints
        self.members = []  # the group's members, in group-rank order (set by the scaling policy)
        self.block: dict[int, list[Unit]] = {}  # the block out now (rank -> its units); {} between blocks
        self.results: dict[int, dict[str, list[Any]]] = {}  # its members' rows, as they come back
        self.lost: dict[int, RunLost] = {}  # its members lost on the way
        self.turn_taken = False  # the scaling policy had its turn at this boundary: the next block may go
        self.to_step_boundary = False  # the next block ends at a step's end (a draining node's checkpoint)
        self.checkpointed_at = -1  # the step whose checkpoints were queued last (each step's once)
        self.before_deal: Callable[[], None] = lambda: None  # the group re-formed if the membership changed

    # ------------------------------------------------------------------ a block's results
    def collect(self, rank: int, units: list[Unit], result: dict[str, list[Any]]) -> bool:
        """A member's segment is back: held until the block is whole (which rounds stand is known then)."""
        self.results[rank] = result
        return True

    def defer(self, lost: RunLost, rank: int | None) -> bool:
        """A member of the block out now is lost (`rank`: whose call said so; a peer's failure names no
        rank): set aside, its calls out of `pending`, until the block is whole. False if not the block's."""
        target = lost.target if lost.target is not None else rank
        if target not in self.block or target in self.results:
            return False
        self.lost.setdefault(target, lost)
        self.take(target)
        return True

    def back(self) -> bool:
        """Every member of the block out now answered or was lost."""
        return bool(self.block) and set(self.block) <= set(self.results) | set(self.lost)

    def close(self) -> BlockEnd:
        """The block's books: the rounds every survivor completed stand (an all-reduce completes only
        with every member's share), their units are done; the rest go back to the plan; a lost member's
        units in rounds that stand were applied but have no row."""
        block, results, plan = self.block, self.results, self.work
        rounds = len(next(iter(block.values())))
        done = {rank: r["broken"][0]["rounds"] if "broken" in r else rounds for rank, r in results.items()}
        kept = min(done.values(), default=0)
        rows = {}
        for rank, result in results.items():
            result.pop("broken", None)
            rows[rank] = {k: v[:kept] for k, v in result.items()}  # a round only some survivors completed is undone
        applied_all: list[Unit] = []
        redo: list[Unit] = []
        without_row: dict[int, list[Unit]] = {}
        for rank, units in block.items():
            applied, abandoned = real_units(units[:kept]), real_units(units[kept:])
            applied_all += applied
            redo += abandoned
            if rank in self.lost:
                without_row[rank] = applied
        # Each unit once: members that took a unit together (a data-parallel rank's tensor-parallel
        # workers: RoundPlan.share) all list it.
        finished = plan.complete(list(dict.fromkeys(applied_all)))
        redo = list(dict.fromkeys(redo))
        if redo:
            plan.requeue(redo)
        source = min((r for r in results if done[r] == kept), default=None)
        end = BlockEnd(next(iter(block.values()))[0][0], rows, sorted(set(finished)), redo, without_row)
        end.lost, end.source = self.lost, source
        self.block, self.results, self.lost, self.turn_taken = {}, {}, {}, False
        return end

    def at_boundary(self, finished: list[int]) -> None:
        """Between blocks: the evaluations of the epochs `finished`, then the checkpoints due here, on the
        first member (every member holds the same state; its calls run in order)."""
        plan, rank = self.work, self.members[0]
        self._evaluations(finished)
        # Mid-step (a member lost part of one) nothing is due; a block that was abandoned whole moved no
        # step, and the checkpoints of this step were queued at the boundary that reached it.
        if not plan.aligned or plan.steps_done == self.checkpointed_at:
            return
        self.checkpointed_at = plan.steps_done
        for due in self.schedule.due_after(plan.steps_done):
            if due.kind != FINAL:  # the controller takes the final one once every worker is done
                self.call("state", rank, (due.name, due.step))

    # ------------------------------------------------------------------ dealing
    def feed(self, rank: int) -> None:
        """Nothing per member: a block goes to every member at once (`feed_all`)."""
        self.feed_all()

    def feed_all(self) -> None:
        """The next block, once the last one and its boundary's calls are back and the scaling policy
        had its turn; the group first re-forms if the membership changed."""
        if self.pending or self.block or not self.turn_taken or self.work.finished:
            return
        self.before_deal()
        self.block = self.work.deal(self.members, self.rounds, to_step_boundary=self.to_step_boundary)
        if not self.block:
            if not self.work.finished:
                raise RuntimeError("elastic round plan stalled before all units were done")  # a bug
            return
        for rank, units in self.block.items():
            self.call("segment", rank, units)

    def completed(self, rank: int, units: list[Unit]) -> None:
        raise AssertionError("a block's units are completed when it is whole (`close`)")

    # ------------------------------------------------------------------ holds and stops
    def reached_hold(self) -> bool:
        """At the boundary (the scaling policy's turn taken) every unit before the --chaos hold is done."""
        hold, plan = self.work.hold, self.work
        between = not self.pending and not self.block and self.turn_taken and not plan.finished
        return between and hold is not None and plan.steps_done >= hold

    def stop(self) -> int:
        """End the plan at the step dealt last (a callback asked the run to stop): the block out now
        finishes, an epoch this completes is evaluated. Returns the new total."""
        total = self.work.stop()
        self._evaluations(self.work.completed_by_stop)
        self.feed_all()
        return total

    def _evaluations(self, epochs: list[int]) -> None:
        """Each of `epochs` that is evaluated (every --eval-every, and the last), on the first member."""
        last = (self.work.total_steps - 1) // self.work.steps_per_epoch
        for epoch in epochs:
            if evaluates(epoch, last, self.eval_every):
                self.call("eval", self.members[0], epoch)
