"""Every departure of an elastic run is decided by the failure policy (orchestrator/failure_policy.py):
a member lost while the run keeps MIN is a LEAVE (no failure counted, no restart), anything else is
decided as in a fixed-size run."""

from __future__ import annotations

from distrain.orchestrator.failure_policy import LEAVE, REPLACE, RESTART, LedgerView, Loss, Situation, decide

LEDGER = LedgerView(failures=0, max_failures=0)  # not one failure left: a leave must not need one


def elastic(members: int, member: bool = True, **kw) -> Situation:
    return Situation(elastic_min=2, members=members, member=member, **kw)


def test_a_member_lost_above_min_leaves_whatever_the_failures_left():
    for kind in ("worker", "hang", "node"):
        decision = decide(Loss(kind, 1), LEDGER, elastic(members=3))
        assert (decision.action, decision.remedy) == (LEAVE, LEAVE), kind


def test_a_loss_that_would_go_below_min_is_a_failure():
    decision = decide(Loss("worker", 1), LedgerView(0, 3), elastic(members=2))
    assert decision.action == RESTART
    ps = elastic(members=2, training=True, transport="ps", workers=2, host_alive=True)
    assert decide(Loss("worker", 1), LedgerView(0, 3), ps).action == REPLACE


def test_shards_unknown_targets_and_non_members_never_leave():
    assert decide(Loss("shard", None), LedgerView(0, 3), elastic(members=3)).action == RESTART
    assert decide(Loss("hang", None), LedgerView(0, 3), elastic(members=3)).action == RESTART
    assert decide(Loss("worker", 2), LedgerView(0, 3), elastic(members=3, member=False)).action == RESTART


def test_a_fixed_size_run_has_no_leaves():
    assert decide(Loss("worker", 1), LedgerView(0, 3), Situation(members=3, member=True)).action == RESTART
