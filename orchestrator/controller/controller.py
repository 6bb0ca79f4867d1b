"""The run's life across attempts: the `Controller`.

    Controller(config, plan, state, group, emit, hooks).run() -> RunResult

An attempt (orchestrator/controller/attempt.py) starts the group's workers from the restore point and
trains to the end. A loss it cannot take in place ends it with `RunLost`: the controller asks the
failure policy (orchestrator/failure_policy.py `decide`), counts the failure in the ledger, and either
restarts from the restore point in a fresh attempt (RECOVERING -> STARTING) or, past --max-failures,
records the run as failed and raises its one line (`RunFailed`). The stages are `Stage`
(orchestrator/controller/status.py); `machine.history` is what a run went through.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from distrain.config import RunConfig
from distrain.errors import DistrainError, RunFailed
from distrain.orchestrator.callbacks import Callbacks
from distrain.orchestrator.controller.attempt import Attempt
from distrain.orchestrator.controller.events import EventHandler, RunResult
from distrain.orchestrator.controller.group import WorkerGroup
from distrain.orchestrator.controller.run_state import Plan, RunState, recorded
from distrain.orchestrator.controller.status import Stage, StageMachine, Status
from distrain.orchestrator.failure_policy import FAIL, Situation, decide
from distrain.orchestrator.files import atomic_write_text
from distrain.orchestrator.recovery import Failure, RunLost
from distrain.orchestrator.summary import summarize


class Controller:
    def __init__(
        self,
        config: RunConfig,
        plan: Plan,
        state: RunState,
        group: WorkerGroup,
        emit: EventHandler,
        hooks: Callbacks | None = None,
        placed_ranks: Callable[[], list[int]] | None = None,
    ) -> None:
        self.config, self.plan, self.state, self.group = config, plan, state, group
        self.emit = emit
        self.hooks = hooks if hooks is not None else Callbacks()
        self.machine = StageMachine()
        self.attempts = 0
        # The ranks each attempt starts workers in (an elastic run's: the slots placed by then).
        self.placed_ranks = placed_ranks or (lambda: list(range(config.num_worker_actors)))

    def run(self) -> RunResult:
        while True:  # one attempt per failure survived (orchestrator/recovery.py)
            self.attempts += 1
            self.group.start(self.placed_ranks())
            attempt = Attempt(self.config, self.plan, self.group, self.state, self.emit, self.hooks, self.machine)
            try:
                return attempt.train()
            except RunLost as lost:
                self.machine.to(Stage.RECOVERING)
                try:
                    self.recover(lost, list(attempt.pending))
                except DistrainError:  # past --max-failures: record what there is, then say so
                    self.machine.to(Stage.FAILED)
                    self.hooks.end(attempt.finish(Status.FAILED, checkpoint=False), quiet=True)
                    raise
                self.group.restart()
                self.machine.to(Stage.STARTING)

    def recover(self, lost: RunLost, dropped: list[object]) -> None:
        """End the attempt `lost` ended and count the failure; then, as the failure policy decides, restart
        from the restore point or (past --max-failures) stop the run with its one line."""
        state, config = self.state, self.config
        # Outside the loop: restart or fail.
        decision = decide(lost.loss, state.ledger.view(state.point, self.plan.run_dir), Situation())
        steps_per_epoch, at_step = state.steps_per_epoch, state.steps_done
        self.group.kill_all()
        self.group.discard(dropped, min(10.0, config.collective_timeout_s))  # the attempt's calls in flight
        event = state.ledger.record(lost, at_step, state.point, time.time() - state.run_start)
        if decision.action == FAIL:
            raise RunFailed(decision.reason)
        state.sink.keep_before(state.point.global_step, steps_per_epoch)
        self.plan.checkpoint = state.point.payload
        self.emit(
            Failure(
                len(state.ledger.events),
                event["kind"],
                event["target"],
                at_step,
                state.point.global_step,
                config.max_failures,
                from_start=state.point.payload is None,
            )
        )


def record_interrupted(config: RunConfig, plan: Plan, state: RunState) -> None:
    """Interrupted before an attempt could record anything (placement, workers starting): the run
    directory still gets its metrics (none, or those of earlier attempts) and a summary that says so."""
    epochs_done = state.steps_done // state.steps_per_epoch if state.steps_per_epoch else 0
    df = state.sink.table().to_pandas()
    state.sink.write(plan.run_dir / "metrics.parquet")
    config_dict = recorded(config, plan.run_dir).to_dict()
    elapsed = time.time() - state.run_start
    summary = summarize(df, config_dict, state.run_start, elapsed, Status.INTERRUPTED.value, epochs_done)
    summary.update(state.ledger.summary())
    atomic_write_text(plan.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
