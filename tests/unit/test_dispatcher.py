"""The work dispatcher with a fake submit function (no Ray): what each worker is sent, in which order."""

from __future__ import annotations

from pathlib import Path

from distrain.orchestrator.dispatcher import Dispatcher
from distrain.orchestrator.work import WorkPlan


class FakeWorkers:
    """Records every call; an actor runs its calls in order, so `run` completes each worker's oldest."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []

    def submit(self, kind: str, rank: int, payload: object) -> int:
        self.calls.append((kind, rank, payload))
        return len(self.calls) - 1  # the handle

    def sent_to(self, rank: int) -> list[tuple[str, object]]:
        """What `rank` was sent, segments as (first global step, last + 1)."""
        out = []
        for kind, r, payload in self.calls:
            if r == rank:
                out.append((kind, span(payload) if kind == "segment" else payload))
        return out


def span(units, spe: int = 5) -> tuple[int, int]:
    steps = [e * spe + s for e, s, _ in units]
    return steps[0], steps[-1] + 1


def run(dispatch: Dispatcher, holds: list[int | None] | None = None, at_hold: list[int] | None = None) -> None:
    """The controller loop's part: complete calls in order, round-robin over workers, feed on results;
    at a hold note the step count (`at_hold`) and lift it to the next of `holds`."""
    dispatch.feed_all()
    while dispatch.pending:
        for rank in range(dispatch.work.workers):
            mine = [h for h, call in dispatch.pending.items() if call[1] == rank]
            if not mine:
                continue
            kind, _, payload = dispatch.done(min(mine))
            if kind == "segment":
                dispatch.completed(rank, payload)
            if kind == "eval":
                continue
            if dispatch.reached_hold():
                assert at_hold is not None and holds is not None
                at_hold.append(dispatch.work.steps_done)
                dispatch.lift_hold(holds.pop(0))
            else:
                dispatch.feed(rank)


def test_static_plan_queues_each_epochs_evaluation_and_checkpoint_right_behind_its_last_segment():
    fake = FakeWorkers()
    work = WorkPlan(total_steps=10, steps_per_epoch=5, workers=2, segment_steps=3, shared=False)
    dispatch = Dispatcher(work, fake.submit, eval_every=2, checkpoint_every=1)
    dispatch.feed_all()
    assert [dispatch.in_flight(r) for r in (0, 1)] == [2, 2]  # two segments queued per worker
    run(dispatch)
    assert work.finished and not dispatch.pending
    assert fake.sent_to(0) == [
        ("segment", (0, 3)),
        ("segment", (3, 5)),
        ("state", ("epoch-0001.pt", 5)),  # epoch 0 is not evaluated (every 2 epochs) but checkpointed
        ("segment", (5, 8)),
        ("segment", (8, 10)),
        ("eval", 1),
        ("state", ("epoch-0002.pt", 10)),
    ]
    assert fake.sent_to(1) == [("segment", (0, 3)), ("segment", (3, 5)), ("segment", (5, 8)), ("segment", (8, 10)),
                               ("eval", 1)]  # fmt: skip


def test_a_chaos_hold_stops_the_hand_out_until_every_worker_and_its_checkpoint_are_there():
    fake = FakeWorkers()
    work = WorkPlan(total_steps=10, steps_per_epoch=10, workers=2, segment_steps=20, shared=False, cut_every=4)
    work.hold = 6
    dispatch = Dispatcher(work, fake.submit, checkpoint_steps=4)
    at_hold: list[int] = []
    run(dispatch, holds=[None], at_hold=at_hold)
    assert at_hold == [6]  # reached once, with exactly 6 steps done
    assert fake.sent_to(0) == [
        ("segment", (0, 4)),
        ("state", ("step-00000004.pt", 4)),
        ("segment", (4, 6)),  # no unit at or past the hold until it is lifted
        ("segment", (6, 8)),
        ("state", ("step-00000008.pt", 8)),
        ("segment", (8, 10)),
        ("eval", 0),  # the last epoch is always evaluated
    ]
    assert work.finished


def test_shared_plan_evaluates_an_epoch_on_every_worker_once_its_last_unit_is_done():
    fake = FakeWorkers()
    work = WorkPlan(total_steps=8, steps_per_epoch=4, workers=2, segment_steps=2, shared=True, cut_every=4)
    done_at_eval: dict[int, int] = {}

    def submit(kind: str, rank: int, payload: object) -> int:
        if kind == "eval":
            done_at_eval[payload] = sum(work.units_done.values())
        return fake.submit(kind, rank, payload)

    dispatch = Dispatcher(work, submit, eval_every=1, checkpoint_steps=4)
    dispatch.feed_all()
    assert [dispatch.in_flight(r) for r in (0, 1)] == [1, 1]  # one segment each: units stay for whoever is free
    run(dispatch)
    assert work.finished
    evals = [(rank, payload) for kind, rank, payload in fake.calls if kind == "eval"]
    assert sorted(evals) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    states = [payload for kind, _, payload in fake.calls if kind == "state"]
    assert states == [("step-00000004.pt", 4)]  # step 8 is the run's end: the final checkpoint covers it
    assert done_at_eval == {0: 4 * 2, 1: 8 * 2}  # queued once every unit (steps x slices) up to the epoch was done


def test_take_removes_a_lost_workers_calls_in_order_and_stop_ends_at_the_furthest_step_handed_out():
    fake = FakeWorkers()
    work = WorkPlan(total_steps=20, steps_per_epoch=5, workers=2, segment_steps=2, shared=False)
    dispatch = Dispatcher(work, fake.submit)
    dispatch.feed_all()
    taken = dispatch.take(1)
    assert [(kind, span(p)) for _, (kind, _, p) in taken] == [("segment", (0, 2)), ("segment", (2, 4))]
    assert dispatch.in_flight(1) == 0 and dispatch.in_flight(0) == 2
    assert dispatch.stop() == 4  # both workers were handed steps up to 4
    assert dispatch.work.total_steps == 4
    assert dispatch.evals_outstanding() == {0}  # epoch 0 is the last one now: worker 1, out of work, scores it


def test_checkpoints_are_written_in_step_order_whatever_order_their_states_come_back_in():
    """ray.wait may hand over the state taken at step 6 before the one taken at step 4 (both ready):
    step 6 waits until step 4's state is in, so the latest checkpoint never moves back a step."""
    from types import SimpleNamespace

    from distrain.orchestrator.channel_checkpoint import ChannelStates
    from distrain.orchestrator.run import _Driver

    written: list[int] = []
    driver = SimpleNamespace(saves={}, steps_per_epoch=100, steps_done=8, channel_states=ChannelStates())
    driver.run_dir = Path("no-shards")  # whole states: no sharded run's shards to wait for
    driver.members = lambda: [0]
    driver._save = lambda name, state, epochs, step: written.append(step)
    dispatch = Dispatcher(WorkPlan(8, 100, 1, 2, False, cut_every=2), FakeWorkers().submit, checkpoint_steps=2)
    for step in (4, 6):
        dispatch.call("state", 0, (f"step-{step}.pt", step))
    assert dispatch.checkpoints_outstanding() == {4, 6}
    dispatch.done(1)  # step 6's state is in first
    driver.saves[6] = [("step-6.pt", {})]
    _Driver._save_complete(driver, set(), dispatch.checkpoints_outstanding())
    assert written == []  # not before step 4's
    dispatch.done(0)
    driver.saves[4] = [("step-4.pt", {})]
    _Driver._save_complete(driver, set(), dispatch.checkpoints_outstanding())
    assert written == [4, 6]
