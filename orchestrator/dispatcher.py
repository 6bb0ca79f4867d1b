"""The work dispatcher of one phase: which worker gets which call next, and what is in flight.

The controller's phase loop (orchestrator/controller/loop.py) waits on `pending` and reacts to
results; this class decides what to send and keeps the books of what was sent. It calls nothing
itself: every call goes through `submit(kind, rank, payload) -> handle` (the loop's asks the
`WorkerGroup`), so it is tested without Ray (tests/unit/test_dispatcher.py).

A call, as kept in `pending` (handle -> call), is (kind, rank, payload):
- "segment": units of the `WorkPlan` to train (static plans keep two queued per worker, shared one);
- "eval": an epoch whose share of the test set the worker scores;
- "state": (checkpoint name, global step), the state to checkpoint;
- "setup": a replacement worker being set up (payload: its failure event), made by
  orchestrator/replacement.py and only tracked here.

Static plans queue an epoch's evaluation (and its epoch checkpoint) on each worker right behind its
last segment of that epoch, and a --checkpoint-steps checkpoint behind rank 0's segment that ends at
that step (WorkPlan cuts segments there), so no worker ever waits for the driver: an actor runs its
calls in order, so they see the state after exactly that step. Shared plans (independent workers)
evaluate an epoch once its last unit is done. Which checkpoints are due after which step is the
`CheckpointSchedule`'s to say (orchestrator/checkpoint_schedule.py), the rule the workers ship their
codec state by. A --chaos `hold` stops the hand-out at its step
(WorkPlan.hold); the driver injects the fault once `reached_hold`, then `lift_hold`s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distrain.orchestrator.checkpoint_schedule import CheckpointSchedule
from distrain.orchestrator.work import Unit, WorkPlan

Call = tuple[str, int, Any]  # (kind, rank, payload)
Submit = Callable[[str, int, Any], Any]  # makes the call; returns the handle the loop waits on


def evaluates(epoch: int, last_epoch: int, eval_every: int) -> bool:
    """Whether `epoch` gets an evaluation: every --eval-every epochs, and the last one always."""
    return epoch == last_epoch or bool(eval_every and (epoch + 1) % eval_every == 0)


class Dispatcher:
    def __init__(
        self,
        work: WorkPlan,
        submit: Submit,
        *,
        eval_every: int = 0,
        checkpoint_every: int = 0,
        checkpoint_steps: int = 0,
    ) -> None:
        self.work = work
        self.submit = submit
        self.eval_every = eval_every  # --eval-every (epochs)
        self.checkpoint_every = checkpoint_every  # --checkpoint-every (epochs)
        self.checkpoint_steps = checkpoint_steps  # --checkpoint-steps
        self.shared = work.shared
        self.depth = 1 if work.shared else 2  # queued segments per worker (shared: keep units for whoever is free)
        self.pending: dict[Any, Call] = {}
        self.open_epoch: list[int | None] = [None] * work.workers  # static: epoch of each worker's last segment
        # The ranks with a worker now: every slot, except in an elastic run (orchestrator/membership.py),
        # where one member (the lowest rank) scores the whole test set and takes the epoch checkpoints.
        self.members: list[int] = list(range(work.workers))
        self.elastic = False

    @property
    def schedule(self) -> CheckpointSchedule:
        """Which checkpoints are due after which step (the workers ship their codec state by the same
        rule); built on each use, as a callback's `stop` moves the plan's end."""
        work = self.work
        return CheckpointSchedule(work.total_steps, work.steps_per_epoch, self.checkpoint_every, self.checkpoint_steps)

    # ------------------------------------------------------------------ the books
    def call(self, kind: str, rank: int, payload: Any) -> None:
        self.pending[self.submit(kind, rank, payload)] = (kind, rank, payload)

    def track(self, handle: Any, call: Call) -> None:
        """A call made elsewhere (a replacement's setup) that the loop waits on too."""
        self.pending[handle] = call

    def done(self, handle: Any) -> Call:
        """Its result is in: no longer in flight."""
        return self.pending.pop(handle)

    def take(self, rank: int) -> list[tuple[Any, Call]]:
        """Every call queued on `rank` (a lost worker's), in the order sent, out of `pending`."""
        calls = [(handle, call) for handle, call in self.pending.items() if call[1] == rank]
        for handle, _ in calls:
            del self.pending[handle]
        return calls

    def in_flight(self, rank: int) -> int:
        """Segments queued on `rank`."""
        return sum(1 for kind, r, _ in self.pending.values() if kind == "segment" and r == rank)

    def evals_outstanding(self) -> set[int]:
        """Epochs whose evaluation calls are still queued."""
        return {payload for kind, _, payload in self.pending.values() if kind == "eval"}

    def checkpoints_outstanding(self) -> set[int]:
        """Steps whose checkpoint `state` calls are still queued."""
        return {payload[1] for kind, _, payload in self.pending.values() if kind == "state"}

    def collect(self, rank: int, units: list[Unit], result: dict[str, Any]) -> bool:
        """Whether a segment's result is held back (lock-step blocks: orchestrator/block_dispatcher.py);
        here each is recorded as it comes."""
        return False

    def defer(self, lost: Any, rank: int | None) -> bool:
        """Whether a loss waits for its block's end (lock-step blocks); here the loop decides at once."""
        return False

    # ------------------------------------------------------------------ handing out work
    def feed(self, rank: int) -> None:
        """Queue segments on `rank` up to the depth, with the evaluations and checkpoints behind them."""
        work, spe = self.work, self.work.steps_per_epoch
        while self.in_flight(rank) < self.depth:
            if work.held(rank):  # waits for a --chaos fault; an epoch it has finished is evaluated now
                epoch = self.open_epoch[rank]
                if not self.shared and epoch is not None and work.cursor[rank] // spe != epoch:
                    self.queue_eval(rank, epoch)
                    self.open_epoch[rank] = None
                return
            units = work.next_segment(rank)
            epoch = self.open_epoch[rank]
            if not self.shared and epoch is not None and (not units or units[0][0] != epoch):
                self.queue_eval(rank, epoch)  # this worker is through with `epoch`
                self.open_epoch[rank] = None
            if not units:
                return
            self.open_epoch[rank] = units[-1][0]
            self.call("segment", rank, units)
            if not self.shared and rank == 0:  # segments end at checkpoint steps (WorkPlan)
                last = units[-1]
                self.queue_step_checkpoint(0, last[0] * spe + last[1] + 1)

    def feed_all(self) -> None:
        for rank in self.members:
            self.feed(rank)

    def evaluator(self) -> int:
        """The rank that takes the epoch checkpoints (and, elastic, the whole evaluation)."""
        return self.members[0] if self.elastic else 0

    def eval_ranks(self) -> list[int]:
        """Who scores an epoch: every worker its share, or an elastic run's one member the whole set."""
        return [self.evaluator()] if self.elastic else list(range(self.work.workers))

    def queue_eval(self, rank: int, epoch: int) -> None:
        """`rank`'s evaluation of `epoch` (if it is evaluated), and on rank 0 the epoch's checkpoint if due."""
        total, spe = self.work.total_steps, self.work.steps_per_epoch
        if evaluates(epoch, (total - 1) // spe, self.eval_every):
            self.call("eval", rank, epoch)
        due = self.schedule.epoch_checkpoint(epoch) if rank == self.evaluator() else None
        if due is not None:
            self.call("state", 0, (due.name, due.step))

    def queue_step_checkpoint(self, rank: int, step: int) -> None:
        """A --checkpoint-steps checkpoint of the state after `step` steps, if due, behind `rank`'s queue."""
        due = self.schedule.step_checkpoint(step)
        if due is not None:
            self.call("state", rank, (due.name, due.step))

    def completed(self, rank: int, units: list[Unit]) -> None:
        """`rank`'s segment `units` came back. Shared plans: evaluate the epochs this completed, and
        checkpoint a --checkpoint-steps step the count just passed, behind this worker's queue."""
        before = self.work.steps_done
        finished = self.work.complete(units)
        if not self.shared:
            return
        for epoch in finished:
            for r in self.eval_ranks():
                self.queue_eval(r, epoch)
        due = self.schedule.step_crossed(before, self.work.steps_done)
        if due is not None:
            self.call("state", rank, (due.name, due.step))

    # ------------------------------------------------------------------ holds and stops
    def reached_hold(self) -> bool:
        """Every worker is at the --chaos hold and the checkpoints of steps up to it are taken."""
        hold = self.work.hold
        if hold is None or self.work.steps_done < hold:
            return False
        return not any(kind == "state" and payload[1] <= hold for kind, _, payload in self.pending.values())

    def lift_hold(self, next_hold: int | None) -> None:
        """The fault at the hold was injected: hold at the next one, and feed everyone."""
        self.work.hold = next_hold
        self.feed_all()

    def stop(self) -> int:
        """End the plan at the last step already handed out (a callback asked the run to stop), evaluate
        the epoch this cut short if it is complete already, feed everyone. Returns the new total."""
        total = self.work.stop()
        for epoch in self.work.completed_by_stop:
            for r in self.eval_ranks():
                self.queue_eval(r, epoch)
        self.feed_all()
        return total
