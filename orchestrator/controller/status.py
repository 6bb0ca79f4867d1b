"""The run's outcome (`Status`, the `status` of summary.json) and its life as a state machine (`Stage`).

Status values are the strings summary.json has always held; `Status` is a `StrEnum`, so a summary read
back compares equal to it and `json.dumps` writes the plain string.

The stages and the moves between them (`MOVES`; any other move is a bug and raises):

    STARTING ──> PLACING ──> TRAINING ──> FINISHING ──> COMPLETED | STOPPED
                    ▲           │
                    └───────────┘ (the next --schedule phase)
    EVALUATING, CHECKPOINTING, RESIZING: entered from STARTING, PLACING, TRAINING, FINISHING or
        RESIZING, and back to it
    any stage ──> RECOVERING ──> STARTING (restart from the restore point, a new attempt)
                            └──> TRAINING (a parameter-server worker replaced in place)
    any stage ──> INTERRUPTED (SIGINT/SIGTERM), FAILED, DIVERGED

STARTING: workers start and load their data (and the restore point's state); PLACING: each phase's
transport and driver-side actors set up; TRAINING: the dispatcher keeps work in flight; EVALUATING and
CHECKPOINTING: an evaluation or checkpoint is recorded; RESIZING: an elastic join or leave;
RECOVERING: a loss is decided by the failure policy and carried out; FINISHING: the final checkpoint,
metrics and summary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum


class Status(StrEnum):
    """summary.json's `status` (the strings are the file format: never change one)."""

    UNFINISHED = "unfinished"  # written with each checkpoint until the run ends
    COMPLETED = "completed"
    STOPPED = "stopped"  # a callback asked the run to stop (orchestrator/callbacks.py)
    DIVERGED = "diverged"  # non-finite (orchestrator/outcome.py's reasons)
    FAILED = "failed"  # --max-failures used up, the user's code raised, a full disk
    INTERRUPTED = "interrupted"  # SIGINT/SIGTERM


class Stage(StrEnum):
    STARTING = "starting"
    PLACING = "placing"
    TRAINING = "training"
    EVALUATING = "evaluating"
    CHECKPOINTING = "checkpointing"
    RESIZING = "resizing"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    INTERRUPTED = "interrupted"
    # terminal
    COMPLETED = "completed"
    STOPPED = "stopped"
    DIVERGED = "diverged"
    FAILED = "failed"


TERMINAL = frozenset({Stage.COMPLETED, Stage.STOPPED, Stage.DIVERGED, Stage.FAILED, Stage.INTERRUPTED})
# From any stage that is not terminal: a signal, a bug or the user's error, NaN; a lost actor.
_ANYWHERE = frozenset({Stage.INTERRUPTED, Stage.FAILED, Stage.DIVERGED, Stage.RECOVERING})
# Recording an evaluation or a checkpoint, and an elastic join or leave, happen inside a longer stage
# and go back to it (`StageMachine.during`); a resize may also run into the next of them.
_BRIEF = frozenset({Stage.EVALUATING, Stage.CHECKPOINTING, Stage.RESIZING})
_HOSTS = frozenset({Stage.STARTING, Stage.PLACING, Stage.TRAINING, Stage.FINISHING, Stage.RESIZING})

MOVES: dict[Stage, frozenset[Stage]] = {
    Stage.STARTING: frozenset({Stage.PLACING}),
    Stage.PLACING: frozenset({Stage.TRAINING, Stage.FINISHING}),
    Stage.TRAINING: frozenset({Stage.PLACING, Stage.FINISHING}),  # PLACING: the next --schedule phase
    Stage.EVALUATING: _HOSTS,
    Stage.CHECKPOINTING: _HOSTS,
    Stage.RESIZING: _HOSTS,
    Stage.RECOVERING: frozenset({Stage.STARTING, Stage.TRAINING}),  # a restart, or a replacement in place
    Stage.FINISHING: frozenset({Stage.COMPLETED, Stage.STOPPED}),
}
for _stage in list(MOVES):
    MOVES[_stage] = (MOVES[_stage] | _ANYWHERE | (_BRIEF if _stage in _HOSTS else frozenset())) - {_stage}
for _stage in TERMINAL:
    MOVES[_stage] = frozenset()


class IllegalMove(RuntimeError):
    """A move `MOVES` does not allow: a bug in the controller, never a user's error."""


class StageMachine:
    """The run's current stage and every stage it went through (`history`, what tests read)."""

    def __init__(self) -> None:
        self.stage = Stage.STARTING
        self.history: list[Stage] = [Stage.STARTING]

    def to(self, stage: Stage) -> None:
        if stage == self.stage:
            return
        if stage not in MOVES[self.stage]:
            raise IllegalMove(f"the run cannot go from {self.stage} to {stage}")
        self.stage = stage
        self.history.append(stage)

    @contextmanager
    def during(self, stage: Stage) -> Iterator[None]:
        """`stage` for the length of the block (an evaluation or checkpoint recorded), then back."""
        before = self.stage
        self.to(stage)
        yield
        if self.stage == stage:  # unless the block moved on (a failure, a signal)
            self.to(before)

    @property
    def ended(self) -> bool:
        return self.stage in TERMINAL


def final_stage(status: Status) -> Stage:
    """The terminal stage a run with `status` ends in."""
    return Stage(status.value)
