"""Elastic membership's books without Ray (issue 18): the dispatcher's members, who may leave, the
display's lines. The runs themselves: tests/integration/test_elastic.py."""

from __future__ import annotations

from collections import Counter

from distrain.cli import membership_line, membership_row
from distrain.config import RunConfig
from distrain.orchestrator.dispatcher import Dispatcher
from distrain.orchestrator.membership import Membership, MembershipChanged
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.work import WorkPlan
from tests.unit.test_dispatcher import FakeWorkers


class Lost:
    """A leave as `Membership.leave` does it to the dispatcher: take the rank's calls, requeue segments."""

    @staticmethod
    def leave(dispatch: Dispatcher, rank: int) -> int:
        taken = dispatch.take(rank)
        units = [u for _, (kind, _, payload) in taken if kind == "segment" for u in payload]
        dispatch.work.requeue(units)
        dispatch.members = [r for r in dispatch.members if r != rank]
        for _, (kind, _, payload) in taken:
            if kind in ("eval", "state"):
                dispatch.call(kind, dispatch.evaluator(), payload)
        dispatch.feed_all()
        return len(units)


def test_an_elastic_shared_plan_feeds_members_only_and_every_unit_is_done_once_across_joins_and_leaves():
    fake = FakeWorkers()
    work = WorkPlan(total_steps=12, steps_per_epoch=6, workers=3, segment_steps=2, shared=True)
    dispatch = Dispatcher(work, fake.submit, eval_every=1, checkpoint_every=1)
    dispatch.elastic, dispatch.members = True, [0]  # MIN 1 placed: slots 1 and 2 are empty
    dispatch.feed_all()
    assert {r for _, r, _ in dispatch.pending.values()} == {0}
    done: Counter = Counter()

    def finish(rank: int) -> None:
        handle = min(h for h, call in dispatch.pending.items() if call[1] == rank)
        kind, _, payload = dispatch.done(handle)
        if kind == "segment":
            done.update(payload)
            dispatch.completed(rank, payload)
        dispatch.feed(rank)

    finish(0)
    dispatch.members = [0, 1, 2]  # slots 1 and 2 placed: they join and are fed
    dispatch.feed(1), dispatch.feed(2)
    assert {r for _, r, _ in dispatch.pending.values()} == {0, 1, 2}
    finish(1)
    redone = Lost.leave(dispatch, 2)  # its segment was never finished: back to the queue
    assert redone == 2 and 2 not in {r for _, r, _ in dispatch.pending.values()}
    assert dispatch.evaluator() == 0
    while dispatch.pending:
        rank = min(call[1] for call in dispatch.pending.values())
        finish(rank)
    assert work.finished and set(done.values()) == {1} and len(done) == 12 * 3  # every unit exactly once
    # One member (the lowest rank) scores the whole test set and takes the epoch checkpoints.
    evals = [(kind, rank) for kind, rank, _ in fake.calls if kind in ("eval", "state")]
    assert evals == [("eval", 0), ("state", 0)] * 2  # epochs 0 and 1, each evaluated and checkpointed


def test_evaluations_and_checkpoints_of_a_leaver_go_to_another_member():
    fake = FakeWorkers()
    work = WorkPlan(total_steps=4, steps_per_epoch=2, workers=2, segment_steps=2, shared=True)
    dispatch = Dispatcher(work, fake.submit, eval_every=1)
    dispatch.elastic, dispatch.members = True, [0, 1]
    dispatch.call("eval", 0, 0)
    Lost.leave(dispatch, 0)
    assert dispatch.evaluator() == 1 and ("eval", 1, 0) in dispatch.pending.values()


def test_a_fixed_plan_evaluates_on_every_worker_as_before():
    work = WorkPlan(total_steps=4, steps_per_epoch=2, workers=3, segment_steps=2, shared=True)
    dispatch = Dispatcher(work, FakeWorkers().submit)
    assert dispatch.eval_ranks() == [0, 1, 2] and dispatch.evaluator() == 0


def test_only_a_worker_loss_that_keeps_min_is_a_leave():
    member = Membership(RunConfig(strategy="async", workers="2..3"), placement=None)  # type: ignore[arg-type]
    workers = [object(), object(), object()]
    assert member.can_leave(workers, RunLost("worker", 1, "ActorDiedError"))
    assert member.can_leave(workers, RunLost("node", 2, "draining"))
    assert member.can_leave(workers, RunLost("hang", 0, "no answer"))
    assert not member.can_leave(workers, RunLost("shard", None, "a shard died"))  # the shards hold the run
    assert not member.can_leave(workers, RunLost("hang", None, "a wait on the shards"))
    workers[2] = None
    assert not member.can_leave(workers, RunLost("worker", 1, "ActorDiedError"))  # below MIN: a failure
    assert not member.can_leave(workers, RunLost("worker", 2, "ActorDiedError"))  # not a member


def test_display_lines():
    event = MembershipChanged(step=40, change="leave", rank=2, cause="node draining", members=1, units_redone=2)
    assert membership_line(event, (1, 3)) == (
        "step 40: worker 2 left (node draining); its 2 unit(s) go to the others; 1 of 1..3"
    )
    joined = MembershipChanged(step=3, change="join", rank=1, cause="placed", members=2)
    assert membership_line(joined, (1, 3)) == "step 3: worker 1 joined (placed); 2 of 1..3"
    summary = {"membership": {"peak_members": 3, "final_members": 1, "joins": 4, "leaves": 4,
                              "samples_redone": 1024, "reform_s": 27.5}}  # fmt: skip
    assert membership_row(summary) == (
        "workers peak / final / joins / leaves",
        "3 / 1 / 4 / 4 (1,024 samples redone, 27.5 s setting up joiners)",
    )
    assert membership_row({}) is None


def test_the_ssp_bound_holds_among_members_and_a_joiner_starts_at_their_least_clock():
    import asyncio

    import numpy as np

    from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard

    async def scenario():
        s = ParameterShard(0, 3, ConsistencyRule.ssp(1), OptimizerSpec("sgd", 0.0, 0.0), np.zeros(2, np.float32))
        g = np.ones(2, np.float32)
        await s.set_members([0])  # slots 1 and 2 are empty: nobody waits on their clocks
        for clock in range(3):
            reply = await asyncio.wait_for(s.push_pull(0, clock, g, 0.1, clock), 1.0)
            assert reply.wait_s == 0 and reply.min_clock == clock + 1
        await s.set_members([0, 1])  # slot 1 joins at the members' least clock (it takes the current θ)
        assert s.clocks[1] == 3 and s.clocks[2] == 0
        reply = await asyncio.wait_for(s.push_pull(0, 3, g, 0.1, 3), 1.0)  # 4 vs 3: within the bound
        blocked = asyncio.create_task(s.push_pull(0, 4, g, 0.1, 4))  # 5 vs 3: waits for slot 1
        await asyncio.sleep(0.05)
        assert not blocked.done()
        s.clocks[1] = 1  # a leaver's clock rebased below (orchestrator/membership.py) ...
        await s.set_members([0])  # ... and gone: the waiter goes on
        reply = await asyncio.wait_for(blocked, 1.0)
        assert reply.wait_s > 0 and reply.min_clock == 5
        await s.set_members([0, 1])  # rejoins: raised to the least again, never lowered
        assert s.clocks[1] == 5

    asyncio.run(scenario())
