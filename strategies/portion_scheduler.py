"""The portion scheduler of backup tasks: hands out a round's portions, and copies of the stragglers'; and
`PortionHandout`, what it shares with Sandblaster's coordinator (strategies/sandblaster_coordinator.py).

Hosted as a Ray async actor (`portion_scheduler(rule)` below builds its spec), called by the workers of a
`--backup-tasks` run (see `strategies/backup_tasks.py`). Rounds are global steps; the round open here is the
one whose portions are handed out. A worker's request also reports the portion it just pushed.

Which portion goes to whom, copies included, is the round's `PortionQueue` (strategies/portion_queue.py,
shared with Sandblaster's coordinator): MapReduce's rule, with the straggler detector's verdict as the
slow set. A worker with nothing to take waits for the round to close. The first copy pushed is the one the
shards keep; the rest are dropped there.
A worker that left an elastic run (`worker_lost`) gives the portions only it held back to the front
of the queue, to whoever is a member.

Both actors that hand out portions (this one per round, the coordinator per data pass) are one
`PortionHandout`: the open queue under one condition, the straggler verdict, the driver's two notices
(`worker_lost`, `mark_slow`) and the completions that wait on the shards in the background.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray

from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.driver_actor import ActorSetup, DriverActor
from distrain.strategies.portion_queue import PortionQueue


@dataclass(frozen=True)
class Assignment:
    epoch: int
    step: int  # within the epoch
    portion: int
    tag: int  # the round as the shards count it (their version while it is open)
    copy: bool  # a speculative copy of a portion another worker is computing


class PortionHandout:
    """The async side of handing out a `PortionQueue` (a subclass opens `self.queue` and counts what a
    lost worker gave back in `_gave_back`): every change is made under `changed` and wakes the waiters."""

    queue: PortionQueue

    def __init__(self) -> None:
        self.changed = asyncio.Condition()
        self.slow: set[int] = set()  # the straggler detector's verdict: no copies for them, theirs copied first
        self.tasks: set[asyncio.Task[Any]] = set()  # background completions (and the coordinator's closings)

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def _pushed(pushes: list[Any]) -> list[Any] | None:
        """The shards' answers to a portion's pushes, once every shard has taken it; None when the pusher
        died with its push refs (OwnerDiedError): whether every shard took it is unknown, so the portion
        stays outstanding, `worker_lost` hands it out again, and the shards count it once."""
        try:
            return list(await asyncio.gather(*pushes))
        except ray.exceptions.RayError:
            return None

    def _gave_back(self, count: int) -> None:
        """Count the `count` portions a lost worker held, handed out again."""

    async def worker_lost(self, worker: int) -> int:
        """`worker` left: the portions only it held go back to the front of the queue; returns how many."""
        async with self.changed:
            back = self.queue.worker_lost(worker)
            self._gave_back(back)
            self.changed.notify_all()
            return back

    async def mark_slow(self, workers: list[int]) -> None:
        """The straggler detector's current verdict (the driver forwards it)."""
        async with self.changed:
            self.slow = set(workers)
            self.changed.notify_all()


class PortionScheduler(PortionHandout):
    def __init__(self, per_round: int, steps_per_epoch: int, start_step: int, first_tag: int = 0) -> None:
        super().__init__()
        self.per_round = per_round  # the round's portions (the shards' portion-rounds rule)
        self.steps_per_epoch = steps_per_epoch
        self.start_step = start_step
        self.first_tag = first_tag  # the shards' version at start_step (0, or a restored run's counter)
        self.round = start_step  # global step whose portions are handed out now
        self.copies_issued = 0
        self.portions_issued = 0
        self.reissued = 0  # portions a leaver held, handed out again
        self._open_round()

    def _open_round(self) -> None:
        self.queue = PortionQueue(self.per_round)

    async def acquire(
        self, worker: int, finished: tuple[int, int, list[Any]] | None, last_epoch: int, last_step: int
    ) -> Assignment | None:
        """The next portion for `worker`, or None once the rounds up to (last_epoch, last_step) are through.

        `finished` = (tag, portion, refs of its pushes to the shards) reports the portion this worker
        just pushed; it counts as done once every shard has taken the push (in the background: the
        worker's next portion does not wait for that).
        """
        upto = last_epoch * self.steps_per_epoch + last_step + 1
        if finished is not None:
            # Done once the shards have it; meanwhile the worker may already take its next portion.
            self._background(self._complete_when_pushed(*finished))
        async with self.changed:
            while self.round < upto:
                taken = self.queue.next_for(worker, self.slow)
                if taken is not None:
                    portion, copy = taken
                    self.copies_issued += copy
                    self.portions_issued += 1
                    epoch, step = divmod(self.round, self.steps_per_epoch)
                    return Assignment(epoch, step, portion, self._tag(), copy)
                await self.changed.wait()
            return None

    def _tag(self) -> int:
        return self.round - self.start_step + self.first_tag

    async def _complete_when_pushed(self, tag: int, portion: int, pushes: list[Any]) -> None:
        if await self._pushed(pushes) is None:
            return
        async with self.changed:
            self._complete(tag, portion)

    def _complete(self, tag: int, portion: int) -> None:
        if tag != self._tag() or not self.queue.complete(portion):
            return  # a round already closed, or a copy of a portion already done
        if self.queue.all_done:
            self.round += 1
            self._open_round()
        self.changed.notify_all()

    def _gave_back(self, count: int) -> None:
        self.reissued += count

    def stats(self) -> dict[str, int]:
        return {
            "portions_issued": self.portions_issued,
            "copies_issued": self.copies_issued,
            "rounds": self.round - self.start_step,
            "reissued": self.reissued,
        }


def portion_scheduler(rule: ConsistencyRule) -> DriverActor:
    """Backup tasks' driver-side actor (`BSP.driver_actors` under --backup-tasks, after the shards): it
    hands out the portions of the shards' portion-rounds `rule`, `per_round` of them a round."""

    def args(setup: ActorSetup) -> dict[str, Any]:
        counters = setup.counters  # the shards' version right now is the open round's tag
        return {
            "per_round": rule.per_round,
            "steps_per_epoch": setup.steps_per_epoch,
            "start_step": setup.start_step,
            "first_tag": counters["version"] if counters is not None else 0,
        }

    return DriverActor("portion_scheduler", PortionScheduler, args=args, notices=("worker_lost", "mark_slow"))
