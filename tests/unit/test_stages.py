"""The run's stages (orchestrator/controller/status.py): the moves a run may make, and the statuses
summary.json has always held."""

from __future__ import annotations

import json

import pytest

from distrain.orchestrator.controller.status import IllegalMove, Stage, StageMachine, Status


def test_status_values_are_the_strings_summary_json_holds():
    assert [s.value for s in Status] == ["unfinished", "completed", "stopped", "diverged", "failed", "interrupted"]
    assert json.dumps({"status": Status.COMPLETED}) == '{"status": "completed"}' and Status.STOPPED == "stopped"


def test_a_run_cannot_skip_training_or_leave_a_terminal_stage():
    machine = StageMachine()
    with pytest.raises(IllegalMove):
        machine.to(Stage.TRAINING)  # not placed yet
    machine.to(Stage.PLACING)
    machine.to(Stage.TRAINING)
    with machine.during(Stage.CHECKPOINTING):
        assert machine.stage == Stage.CHECKPOINTING
    assert machine.stage == Stage.TRAINING
    machine.to(Stage.FINISHING)
    machine.to(Stage.COMPLETED)
    for stage in (Stage.TRAINING, Stage.RECOVERING, Stage.FAILED):
        with pytest.raises(IllegalMove):
            machine.to(stage)
    assert machine.history == [
        Stage.STARTING, Stage.PLACING, Stage.TRAINING, Stage.CHECKPOINTING, Stage.TRAINING, Stage.FINISHING,
        Stage.COMPLETED,
    ]  # fmt: skip


def test_a_failure_inside_a_brief_stage_does_not_go_back_to_it():
    machine = StageMachine()
    machine.to(Stage.PLACING)
    with pytest.raises(RuntimeError), machine.during(Stage.EVALUATING):
        machine.to(Stage.RECOVERING)
        raise RuntimeError
    assert machine.stage == Stage.RECOVERING
