"""The failure policy, on plain data (no Ray): every rule that picks replace, restart or fail."""

from __future__ import annotations

import dataclasses

import pytest

from distrain.orchestrator.failure_policy import (
    FAIL,
    REPLACE,
    RESTART,
    USER_CODE,
    LedgerView,
    Loss,
    Situation,
    decide,
)

WORKER_1 = Loss("worker", 1, "ActorDiedError")
FRESH = LedgerView(failures=0, max_failures=3)
# A loss the loop could replace: PS transport, no backup workers/tasks, worker 1 of 2, its node alive.
REPLACEABLE = Situation(training=True, transport="ps", own_books=False, workers=2, host_alive=True)


def test_a_dead_or_hung_ps_worker_on_a_live_node_is_replaced_in_place():
    for loss in (WORKER_1, Loss("hang", 0, "no answer for 3 s")):
        decision = decide(loss, FRESH, REPLACEABLE)
        assert decision.action == REPLACE and decision.remedy == REPLACE


@pytest.mark.parametrize(
    ("change", "loss"),
    [
        ({"training": False}, WORKER_1),  # starting, a phase switch, the final checkpoint
        ({"transport": "collective"}, WORKER_1),  # a collective group takes no new member
        ({"own_books": True}, WORKER_1),  # backup workers / tasks
        ({"cut_replicas": True}, WORKER_1),  # --fsdp D over the PS: the replica's FSDP group takes no new member
        ({"host_alive": False}, WORKER_1),  # its bundle's node is gone
        ({"workers": 1}, WORKER_1),  # rank 1 is no training worker
        ({}, Loss("shard", None, "a parameter-server shard died")),
        ({}, Loss("node", 1, "node gone")),
        ({}, Loss("hang", None, "a parameter-server wait passed its timeout")),  # no known worker
        ({}, Loss("worker", None, "a peer of the collective group went away")),
    ],
)
def test_every_other_loss_restarts_from_the_restore_point(change, loss):
    decision = decide(loss, FRESH, dataclasses.replace(REPLACEABLE, **change))
    assert decision.action == RESTART and decision.remedy == RESTART and decision.reason


def test_the_default_situation_is_outside_the_loop_so_only_a_restart():
    assert decide(WORKER_1, FRESH, Situation()).action == RESTART


@pytest.mark.parametrize("situation", [REPLACEABLE, Situation()])
def test_up_to_max_failures_the_run_goes_on_and_past_it_fails_with_one_line(situation):
    goes_on = decide(WORKER_1, LedgerView(failures=1, max_failures=2), situation)
    assert goes_on.action != FAIL
    ledger = LedgerView(failures=2, max_failures=2, checkpoint="runs/r/checkpoints/step-6.pt", run_dir="runs/r")
    stops = decide(WORKER_1, ledger, situation)
    assert stops.action == FAIL
    assert stops.remedy == goes_on.action  # the ledger records the loss as what it called for
    assert stops.reason == (  # the run's own directory, not a placeholder (issue 26)
        "worker 1 lost: ActorDiedError (failure 3; --max-failures 2 reached): the run stops; "
        "last good checkpoint: runs/r/checkpoints/step-6.pt; continue with `distrain run --resume runs/r`"
    )
    assert "\n" not in stops.reason


def test_max_failures_zero_fails_at_the_first_loss_and_says_when_there_is_no_checkpoint():
    decision = decide(Loss("shard", None, "died"), LedgerView(0, 0, None, "runs/r"), REPLACEABLE)
    assert decision.action == FAIL and decision.remedy == RESTART
    assert "(failure 1; --max-failures 0 reached)" in decision.reason
    # Nothing to resume: no `--resume` advice (issue 26: it named a literal `<run dir>` with no checkpoint).
    assert "no checkpoint was taken, so there is nothing to resume: start it again" in decision.reason
    assert "--resume" not in decision.reason and "\n" not in decision.reason


def test_max_failures_minus_one_never_stops_the_run():
    assert decide(WORKER_1, LedgerView(failures=10_000, max_failures=-1), REPLACEABLE).action == REPLACE


def test_the_workers_own_error_fails_the_run_at_once_whatever_the_ledger_allows():
    for situation in (REPLACEABLE, Situation()):
        decision = decide(Loss(USER_CODE, 0, "ValueError"), LedgerView(failures=0, max_failures=-1), situation)
        assert decision.action == FAIL and decision.remedy is None
        assert "never retried" in decision.reason
