"""Which checkpoints a run takes after which step (orchestrator/checkpoint_schedule.py), rule by rule, and
that the driver's dispatcher and the workers' codec-state shipping agree on it: a checkpoint whose step
some worker's segment did not ship its codec state for is written without any (silently)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint_schedule import EPOCH, FINAL, STEP, CheckpointSchedule, Due, run_steps
from distrain.orchestrator.dispatcher import Dispatcher
from distrain.orchestrator.work import WorkPlan
from distrain.orchestrator.worker import TrainWorker


def kinds(schedule: CheckpointSchedule) -> dict[int, list[str]]:
    """step -> the kinds of checkpoint due after it, for every step of the run (and around it)."""
    steps = range(-1, schedule.total_steps + 3)
    return {s: [d.kind for d in schedule.due_after(s)] for s in steps if schedule.due_after(s)}


def test_step_checkpoints_fall_on_multiples_of_checkpoint_steps_before_the_end():
    assert kinds(CheckpointSchedule(10, 100, every_steps=4)) == {4: [STEP], 8: [STEP], 10: [FINAL]}
    # At the end the final checkpoint holds that state: no step checkpoint of it as well.
    assert kinds(CheckpointSchedule(12, 100, every_steps=4)) == {4: [STEP], 8: [STEP], 12: [FINAL]}


def test_epoch_checkpoints_fall_on_every_nth_epoch_end_the_last_partial_epoch_none():
    assert kinds(CheckpointSchedule(23, 5, every_epochs=2)) == {10: [EPOCH], 20: [EPOCH], 23: [FINAL]}
    assert kinds(CheckpointSchedule(15, 5, every_epochs=1)) == {5: [EPOCH], 10: [EPOCH], 15: [EPOCH, FINAL]}


def test_a_step_and_an_epoch_checkpoint_on_one_step_are_both_due_step_first():
    assert CheckpointSchedule(20, 5, every_epochs=1, every_steps=10).due_after(10) == [
        Due("step-00000010.pt", 10, STEP),
        Due("epoch-0002.pt", 10, EPOCH),
    ]


def test_without_periodic_checkpoints_only_the_final_one_and_nothing_outside_the_run():
    schedule = CheckpointSchedule(7, 3)
    assert kinds(schedule) == {7: [FINAL]}
    assert schedule.due_after(7) == [Due("final.pt", 7, FINAL)]
    assert not schedule.taken_after(0) and not schedule.taken_after(8) and schedule.taken_after(7)


def test_the_file_names_are_those_on_disk():
    schedule = CheckpointSchedule(40, 8, every_epochs=2, every_steps=3)
    assert schedule.epoch_checkpoint(1) == Due("epoch-0002.pt", 16, EPOCH)
    assert schedule.epoch_checkpoint(0) is None  # epoch 1 of 2
    assert schedule.step_checkpoint(9) == Due("step-00000009.pt", 9, STEP) and schedule.step_checkpoint(10) is None


def test_a_count_that_passes_checkpoint_steps_gets_the_latest_one_it_passed():
    schedule = CheckpointSchedule(20, 100, every_steps=4)
    assert schedule.step_crossed(3, 9) == Due("step-00000008.pt", 8, STEP)  # 4 and 8 passed: the latest
    assert schedule.step_crossed(4, 7) is None  # 4 was reached before
    assert schedule.step_crossed(17, 20) is None  # the end: the final checkpoint's
    assert CheckpointSchedule(20, 100).step_crossed(3, 9) is None


def test_a_period_closes_at_epoch_ends_and_checkpoint_steps():
    schedule = CheckpointSchedule(11, 4, every_steps=3)
    assert [s for s in range(1, 12) if schedule.closes_period(s)] == [3, 4, 6, 8, 9, 11]


def test_the_run_s_total_is_its_epochs_at_most_max_steps():
    assert run_steps(3, 10) == 30 and run_steps(3, 10, 25) == 25 and run_steps(3, 10, 40) == 30
    config = RunConfig(epochs=3, max_steps=25, checkpoint_every=2, checkpoint_steps=7)
    assert CheckpointSchedule.of_run(config, 10) == CheckpointSchedule(25, 10, 2, 7)


class Channel:
    def state_dict(self) -> dict:
        return {"grads": {"residual": 1}}  # a codec's (non-empty) state


def worker_shipping(config: RunConfig, spe: int) -> TrainWorker:
    """A TrainWorker as far as `_attach_channel_state` reads it (its schedule as `_build` makes it)."""
    worker = object.__new__(TrainWorker)
    worker.sharder = SimpleNamespace(steps_per_epoch=spe)
    worker.checkpoints = CheckpointSchedule.of_run(config, spe)
    worker.strategy = SimpleNamespace(channel=Channel())
    return worker


def drive(config: RunConfig, spe: int, workers: int) -> tuple[set[int], dict[int, set[int]]]:
    """A static plan run as the phase loop runs it (actors take their calls in order): the steps the
    dispatcher queued a checkpoint's `state` call at, and each rank's steps its segments shipped codec
    state at (TrainWorker's decision on each segment it was sent)."""
    total = run_steps(config.epochs, spe, config.max_steps)
    work = WorkPlan(total, spe, workers, config.segment_steps, False, 0, config.checkpoint_steps)
    pending: list[tuple[int, str, int, object]] = []
    ids = itertools.count()

    def submit(kind: str, rank: int, payload: object) -> int:
        handle = next(ids)
        pending.append((handle, kind, rank, payload))
        return handle

    dispatch = Dispatcher(
        work, submit, checkpoint_every=config.checkpoint_every, checkpoint_steps=config.checkpoint_steps
    )
    shipped: dict[int, set[int]] = {rank: set() for rank in range(workers)}
    queued: set[int] = set()
    sender = worker_shipping(config, spe)
    dispatch.feed_all()
    while dispatch.pending:
        for rank in range(workers):
            mine = [call for call in pending if call[2] == rank and call[0] in dispatch.pending]
            if not mine:
                continue
            handle, kind, _, payload = mine[0]
            dispatch.done(handle)
            if kind == "state":
                queued.add(payload[1])
            if kind == "segment":
                rows: dict = {}
                sender._attach_channel_state(rows, payload[-1])
                shipped[rank] |= {snapshot["step"] for snapshot in rows.get("channel_state", [])}
                dispatch.completed(rank, payload)
            dispatch.feed(rank)
    assert work.finished
    return queued, shipped


GRID = list(
    itertools.product(
        (4, 5),  # steps per epoch
        (2, 3),  # --epochs
        (0, 7, 11),  # --max-steps
        (0, 1, 2),  # --checkpoint-every
        (0, 3, 4),  # --checkpoint-steps
        (3, 8),  # --segment-steps
    )
)


@pytest.mark.parametrize("spe,epochs,max_steps,every,steps,segment", GRID)
def test_every_checkpoint_the_dispatcher_queues_has_every_rank_s_codec_state_and_no_other(
    spe, epochs, max_steps, every, steps, segment
):
    config = RunConfig(
        epochs=epochs, max_steps=max_steps, checkpoint_every=every, checkpoint_steps=steps, segment_steps=segment
    )
    queued, shipped = drive(config, spe, workers=2)
    total = run_steps(epochs, spe, max_steps)
    taken = queued | {total}  # and the final checkpoint, written once every worker is done
    assert all(ranks == taken for ranks in shipped.values()), (taken, shipped)
    # ... and those are the schedule's, every one of them.
    schedule = CheckpointSchedule.of_run(config, spe)
    assert taken == {s for s in range(1, total + 1) if schedule.taken_after(s)}
