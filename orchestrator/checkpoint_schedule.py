"""Which checkpoints a run takes after which step: one pure rule that every part asks.

The driver's dispatcher queues a checkpoint's `state` call behind the step it is due after
(orchestrator/dispatcher.py), and each worker ships its codec state with a segment that ends at such a
step (orchestrator/worker.py, for orchestrator/channel_checkpoint.py). Both ask this schedule: when they
decided apart, a checkpoint could silently carry no codec state (tests/unit/test_checkpoint_schedule.py
checks that they agree over a grid of runs).

After `s` steps (counted from step 0 of the run) are due:
- an epoch checkpoint (`epoch-NNNN.pt`, --checkpoint-every N epochs) when `s` ends the N-th, 2N-th, ...
  epoch (the last, partial, epoch of a --max-steps run gets none: the final one covers it);
- a step checkpoint (`step-NNNNNNNN.pt`, --checkpoint-steps K) when `s` is a multiple of K before the end;
- the final checkpoint (`final.pt`) at the end, taken by the controller once every worker is done (a
  callback's stop moves the end: the dispatcher's `stop` gives the schedule its new total).
An epoch's and the final checkpoint may fall on one step (both are written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from distrain.orchestrator.checkpoint import checkpoint_name, step_checkpoint_name

if TYPE_CHECKING:
    from distrain.config import RunConfig

EPOCH, STEP, FINAL = "epoch", "step", "final"  # the kinds of checkpoint


class Due(NamedTuple):
    name: str  # the file's name (orchestrator/checkpoint.py)
    step: int  # steps done when it is taken
    kind: str  # EPOCH, STEP or FINAL


def run_steps(epochs: int, steps_per_epoch: int, max_steps: int = 0) -> int:
    """A run's global steps: --epochs of `steps_per_epoch`, at most --max-steps (0: no limit)."""
    total = epochs * steps_per_epoch
    return min(total, max_steps) if max_steps else total


@dataclass(frozen=True)
class CheckpointSchedule:
    total_steps: int
    steps_per_epoch: int
    every_epochs: int = 0  # --checkpoint-every (0: none)
    every_steps: int = 0  # --checkpoint-steps (0: none)

    @classmethod
    def of_run(cls, config: RunConfig, steps_per_epoch: int) -> CheckpointSchedule:
        """The whole run's schedule, as a worker knows it from its config (the driver's dispatcher builds
        its phase's from the work plan, whose end a callback's stop may move)."""
        total = run_steps(config.epochs, steps_per_epoch, config.max_steps)
        from distrain.orchestrator.best_checkpoint import checkpoint_period

        return cls(total, steps_per_epoch, checkpoint_period(config), config.checkpoint_steps)

    def due_after(self, step: int) -> list[Due]:
        """The checkpoints of the state after `step` steps, in the order the dispatcher queues them."""
        spe, due = self.steps_per_epoch, []
        if step <= 0 or step > self.total_steps:
            return due
        if self.every_steps and step % self.every_steps == 0 and step < self.total_steps:
            due.append(Due(step_checkpoint_name(step), step, STEP))
        if self.every_epochs and step % spe == 0 and (step // spe) % self.every_epochs == 0:
            due.append(Due(checkpoint_name(step // spe), step, EPOCH))
        if step == self.total_steps:
            due.append(Due(checkpoint_name(None), step, FINAL))
        return due

    def taken_after(self, step: int) -> bool:
        """Whether any checkpoint (the final one included) holds the state after `step` steps."""
        return bool(self.due_after(step))

    def epoch_checkpoint(self, epoch: int) -> Due | None:
        """`epoch`'s checkpoint (0-based: taken after it), if one is due."""
        return next((d for d in self.due_after((epoch + 1) * self.steps_per_epoch) if d.kind == EPOCH), None)

    def step_checkpoint(self, step: int) -> Due | None:
        """The --checkpoint-steps checkpoint after `step` steps, if one is due."""
        return next((d for d in self.due_after(step) if d.kind == STEP), None)

    def step_crossed(self, before: int, after: int) -> Due | None:
        """The latest --checkpoint-steps checkpoint a step count passed going from `before` to `after`
        (a shared plan's count moves by a segment's units at a time)."""
        every = self.every_steps
        if not every or after // every <= before // every:
            return None
        return self.step_checkpoint(after // every * every)

    def closes_period(self, step: int) -> bool:
        """Whether the replica must be one well-defined model after `step` steps: an epoch ends there
        (an evaluation or a --schedule switch reads it) or a checkpoint is taken. Strategies with local
        periods (local SGD, DiLoCo) average there."""
        return step % self.steps_per_epoch == 0 or self.taken_after(step)
