"""The portion scheduler of backup tasks: hands out a round's portions, and copies of the stragglers'; and
`PortionHandout`, what it shares with Sandblaster's coordinator (strategies/sandblaster_coordinator.py).

Hosted as a Ray async actor (`portion_scheduler(rule)` below builds its spec), called by the workers of a
`--backup-tasks` run (see `strategies/backup_tasks.py`). Rounds are global steps; the round open here is the
one whose portions are handed out. A worker's request also reports the portion it just pushed.

Which portions go to whom, copies included, is the round's `PortionQueue` (strategies/portion_queue.py,
shared with Sandblaster's coordinator): MapReduce's rule, with the straggler detector's verdict as the
slow set. A worker with nothing to take waits for the round to close. The first copy pushed is the one the
shards keep; the rest are dropped there.

What a portion costs is paid per hand-out (a forward and backward, a push of the whole gradient, a round
trip here) whatever its size (RESULTS.md, issue 32): so the scheduler hands out chunks, and
splits and copies only where that pays, by its own clock (`Pace`: each worker's seconds per portion,
from hand-out to the report of its push):
- a worker's first hand-out in a round is its share of what is left, `ceil(left / (1 + the fast workers
  not yet served this round))` portions in a row, computed as one batch; later ones the same rule;
- a worker measured slow here (`Pace.slow`: over 2x the others' median and 5 ms a portion more) gets
  no share: its work would only be copied. Every `PROBE_ROUNDS` rounds it gets a copy of a chunk
  running elsewhere instead, off the round's critical path (its pace is measured anew, and a worker
  that recovered is back). The straggler detector's verdict (slower to come: it judges windows of
  steps) only orders the copies, as before;
- once nothing is left, an idle worker copies an outstanding chunk only where the copy is expected to
  finish first (`Pace.pays`); a pace not measured yet counts as paying (MapReduce's rule as it was).
With no straggler every worker takes its P / N portions as one chunk: plain BSP's work per round.
A worker that left an elastic run (`worker_lost`) gives the portions only it held back to the front
of the queue, to whoever is a member.

Both actors that hand out portions (this one per round, the coordinator per data pass) are one
`PortionHandout`: the open queue under one condition, the straggler verdict, the driver's two notices
(`worker_lost`, `mark_slow`) and the completions that wait on the shards in the background.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import ray

from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.driver_actor import ActorSetup, DriverActor
from distrain.strategies.portion_queue import PortionQueue

PROBE_ROUNDS = 8  # a worker measured slow gets a share again this many rounds after its last
SLOW_RATIO = 2.0  # slow: seconds per portion at least this many times the others' median...
SLOW_EXCESS_S = 0.005  # ...and at least this much more per portion (time-sharing alone makes 1 ms "2x")


@dataclass(frozen=True)
class Assignment:
    epoch: int
    step: int  # within the epoch
    portion: int  # the chunk's first portion
    tag: int  # the round as the shards count it (their version while it is open)
    copy: bool  # a speculative copy of a chunk another worker is computing
    count: int = 1  # portions in the chunk, from `portion`


class Pace:
    """Each worker's seconds per portion, as the scheduler sees it: from a chunk's hand-out to the report of
    its push (its compute, the push, a round trip, and a pull of θ where the round is new), per portion,
    averaged over its last chunks (exponentially, half weight on the newest)."""

    MIN_CHUNKS = 2  # a pace is known from its second chunk on (the first may hold one-off costs)

    def __init__(self) -> None:
        self.chunks: dict[int, tuple[int, float]] = {}  # worker -> (chunks measured, seconds per portion)

    def add(self, worker: int, seconds: float, count: int) -> None:
        sample = seconds / max(1, count)
        measured, before = self.chunks.get(worker, (0, sample))
        self.chunks[worker] = (measured + 1, 0.5 * before + 0.5 * sample)

    @property
    def per_portion(self) -> dict[int, float]:
        """The known paces: those of workers with MIN_CHUNKS chunks measured."""
        return {w: pace for w, (measured, pace) in self.chunks.items() if measured >= self.MIN_CHUNKS}

    def forget(self, worker: int) -> None:
        self.chunks.pop(worker, None)

    def slow(self) -> set[int]:
        """Workers over SLOW_RATIO x the others' median pace and SLOW_EXCESS_S a portion more."""
        out, known = set(), self.per_portion
        for worker, pace in known.items():
            others = [p for w, p in known.items() if w != worker]
            if not others:
                continue
            median = statistics.median(others)
            if pace >= SLOW_RATIO * median and pace - median >= SLOW_EXCESS_S:
                out.add(worker)
        return out

    def pays(self, copier: int, holder: int, started: float, count: int, now: float) -> bool:
        """Whether `copier`, starting a copy of `holder`'s chunk of `count` portions now, is expected to finish
        it first. The holder is expected at `started` + its pace; once past that, as late again as it is
        overdue (so a holder late by more than the copy takes is copied). A pace not measured yet: yes
        (MapReduce's rule)."""
        known = self.per_portion
        mine, theirs = known.get(copier), known.get(holder)
        if mine is None or theirs is None:
            return True
        planned = started + count * theirs
        expected = planned if now <= planned else 2 * now - planned
        return now + count * mine < expected


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
    def __init__(
        self,
        per_round: int,
        steps_per_epoch: int,
        start_step: int,
        first_tag: int = 0,
        workers: int = 0,
        replica_size: int = 1,
    ) -> None:
        super().__init__()
        self.replica_size = replica_size  # worker ranks per client (the driver's notices name ranks)
        self.per_round = per_round  # the round's portions (the shards' portion-rounds rule)
        self.steps_per_epoch = steps_per_epoch
        self.start_step = start_step
        self.first_tag = first_tag  # the shards' version at start_step (0, or a restored run's counter)
        self.round = start_step  # global step whose portions are handed out now
        self.copies_issued = 0
        self.portions_issued = 0
        self.chunks_issued = 0
        self.reissued = 0  # portions a leaver held, handed out again
        self.pace = Pace()
        self.workers = workers  # ranks of the run (0: not told; one portion at a time)
        self.active: set[int] = set(range(workers))  # who takes a share (ranks, less leavers, plus askers)
        self.handed: dict[int, tuple[float, int]] = {}  # worker -> (when its last chunk went out, portions)
        self.shared: dict[int, int] = {}  # worker -> the last round it got a share of
        self._open_round()

    def _open_round(self) -> None:
        self.queue = PortionQueue(self.per_round)
        self.served: set[int] = set()  # workers given a share of the open round

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
            if worker in self.handed:
                when, count = self.handed.pop(worker)
                self.pace.add(worker, time.monotonic() - when, count)
        self.active.add(worker)
        async with self.changed:
            while self.round < upto:
                taken = self._take(worker)
                if taken is not None:
                    portion, count, copy = taken
                    self.copies_issued += copy * count
                    self.portions_issued += count
                    self.chunks_issued += 1
                    self.handed[worker] = (time.monotonic(), count)
                    epoch, step = divmod(self.round, self.steps_per_epoch)
                    return Assignment(epoch, step, portion, self._tag(), copy, count)
                await self.changed.wait()
            return None

    def _take(self, worker: int) -> tuple[int, int, bool] | None:
        """`worker`'s chunk of the open round (module docstring), recorded in the queue; None: nothing now."""
        measured = self.pace.slow()
        slow = self.slow | measured
        queue = self.queue
        if worker in measured:  # its share would only be copied: none, but a copy to measure it by now and then
            if self.round - self.shared.get(worker, self.round - PROBE_ROUNDS) < PROBE_ROUNDS:
                return None
            probe = queue.take(worker, slow - {worker}, fresh=False)
            if probe is not None:
                self.shared[worker] = self.round
            return probe
        if queue.left:
            waiting = self.active - measured - self.served - {worker}
            self.served.add(worker)
            self.shared[worker] = self.round
            # Not told how many workers share a round: one portion at a time.
            count = math.ceil(queue.left / (1 + len(waiting))) if self.workers else 1
            return queue.take(worker, slow, count)
        now = time.monotonic()

        def worth(holder: int, started: float, count: int) -> bool:
            return self.pace.pays(worker, holder, started, count, now)

        return queue.take(worker, slow, worth=worth)

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

    async def worker_lost(self, worker: int) -> int:
        """As `PortionHandout.worker_lost`; it no longer takes a share, and its pace is forgotten."""
        self.active.discard(worker)
        self.handed.pop(worker, None)
        self.pace.forget(worker)
        return await super().worker_lost(worker)

    async def mark_slow(self, workers: list[int]) -> None:
        """The straggler detector's verdict, in worker ranks: a slow worker makes its replica slow."""
        await super().mark_slow(sorted({w // self.replica_size for w in workers}))

    def stats(self) -> dict[str, int]:
        return {
            "portions_issued": self.portions_issued,
            "chunks_issued": self.chunks_issued,
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
            # Its clients: the replicas across cut replicas (--fsdp D: a replica's D workers take each chunk
            # together, strategies/sharded_backup_tasks.py), else the workers.
            "workers": setup.workers // setup.phase.replica_size,
            "replica_size": setup.phase.replica_size,
        }

    return DriverActor("portion_scheduler", PortionScheduler, args=args, notices=("worker_lost", "mark_slow"))
