"""Who trains on what, and when an epoch is complete.

The unit of work is one worker-slice of one global batch: (epoch, step, slice). Global step k of an
epoch is split into N slices (see `trainers/sharding.py`).

- Static plans (every synchronous strategy, and SSP): worker r always takes slice r, step after step,
  so N workers together compute exactly the global batches one large-batch worker would.
- Shared plans (strategies whose workers run independently, e.g. async): units are handed out in
  order to whichever worker asks next, so a slow worker takes fewer of them and nobody waits for it.

Segments never cross an epoch boundary, so the driver can queue each epoch's evaluation between them.
Nor do they cross a `hold` (the step of a `--chaos` fault not yet injected): no unit at or past it is
handed out until the driver lifts it, so the fault strikes after exactly that many steps.
"""

from __future__ import annotations

from collections import Counter

Unit = tuple[int, int, int]  # (epoch, step within the epoch, slice)


class WorkPlan:
    def __init__(
        self,
        total_steps: int,
        steps_per_epoch: int,
        workers: int,
        segment_steps: int,
        shared: bool,
        start_step: int = 0,
        cut_every: int = 0,
    ) -> None:
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch
        self.workers = workers
        self.segment = segment_steps
        self.shared = shared
        self.start_step = start_step
        self.cut_every = cut_every  # static segments also end at multiples of this step (checkpoints)
        self.cursor = [start_step] * workers  # static: next global step of each worker
        self.shared_cursor = start_step * workers  # shared: next unit index (step-major, slice-minor)
        self.units_done: Counter[int] = Counter()  # epoch -> units completed
        self.returned: list[Unit] = []  # shared: units of a lost worker's segment, handed out first
        self.completed_by_stop: list[int] = []  # epochs that stop() cut short and that are complete already
        self.hold: int | None = None  # no unit at or past this global step is handed out (set by the driver)

    # ------------------------------------------------------------------ handing out work
    def held(self, worker: int) -> bool:
        """Whether `worker`'s next units lie at or past `hold` (it waits until the hold is lifted), as
        opposed to there being no work left for it (`next_segment` returns nothing)."""
        if self.hold is None or (self.shared and self.returned):  # returned units are always before the hold
            return False
        step = self.shared_cursor // self.workers if self.shared else self.cursor[worker]
        return self.hold <= step < self.total_steps

    def next_segment(self, worker: int) -> list[Unit]:
        """The next units for `worker`; empty when there are none left for it (or it is `held`)."""
        spe = self.steps_per_epoch
        if self.held(worker):
            return []
        if self.shared and self.returned:
            epoch = self.returned[0][0]  # a segment never crosses an epoch boundary
            take = [u for u in self.returned if u[0] == epoch][: min(self.segment, spe)]
            for unit in take:
                self.returned.remove(unit)
            return take
        if self.shared:
            first = self.shared_cursor
            last_unit = self.total_steps * self.workers
            if first >= last_unit:
                return []
            epoch_end = (first // self.workers // spe + 1) * spe * self.workers
            # At most one worker's share of an epoch (spe units), so every worker gets a part of it.
            stop = min(first + min(self.segment, spe), epoch_end, last_unit)
            if self.hold is not None:
                stop = min(stop, self.hold * self.workers)
            self.shared_cursor = stop
            return [self._unit(u // self.workers, u % self.workers) for u in range(first, stop)]
        step = self.cursor[worker]
        if step >= self.total_steps:
            return []
        stop = min(step + self.segment, (step // spe + 1) * spe, self.total_steps)
        if self.cut_every:
            stop = min(stop, (step // self.cut_every + 1) * self.cut_every)
        if self.hold is not None:
            stop = min(stop, self.hold)
        self.cursor[worker] = stop
        return [self._unit(g, worker) for g in range(step, stop)]

    def _unit(self, global_step: int, slice_: int) -> Unit:
        epoch, step = divmod(global_step, self.steps_per_epoch)
        return (epoch, step, slice_)

    def requeue(self, units: list[Unit]) -> None:
        """Shared plans: a lost worker's units, to be handed out again (before any new unit)."""
        assert self.shared, "static plans re-issue a lost segment to the worker's replacement"
        self.returned.extend(units)

    def stop(self) -> int:
        """End the plan early, at the last step already handed out (a callback asked the run to stop):
        static plans let every worker catch up to the furthest one (so the transports end as at a normal
        end), shared plans complete the step they are in. Returns the new total of steps;
        `completed_by_stop` lists the epochs that are complete now, having been cut short."""
        spe = self.steps_per_epoch
        if self.shared:
            new_total = max(-(-self.shared_cursor // self.workers), self.start_step + 1)  # returned units too
        else:
            new_total = max(max(self.cursor), self.start_step + 1)
        new_total = min(new_total, self.total_steps)
        last = (new_total - 1) // spe
        before = self.units_done[last] == self.units_in_epoch(last)
        self.total_steps = new_total
        now = self.units_done[last] == self.units_in_epoch(last)
        self.completed_by_stop = [last] if now and not before else []
        return new_total

    # ------------------------------------------------------------------ bookkeeping
    def complete(self, units: list[Unit]) -> list[int]:
        """Record finished units; returns the epochs this completed (to be evaluated)."""
        finished = []
        for epoch, _, _ in units:
            self.units_done[epoch] += 1
            if self.units_done[epoch] == self.units_in_epoch(epoch):
                finished.append(epoch)
        return finished

    def units_in_epoch(self, epoch: int) -> int:
        spe = self.steps_per_epoch
        first = max(epoch * spe, self.start_step)
        last = min((epoch + 1) * spe, self.total_steps)
        return max(0, last - first) * self.workers

    @property
    def steps_done(self) -> int:
        """Global steps whose every slice is done (counted from step 0)."""
        return self.start_step + sum(self.units_done.values()) // self.workers

    @property
    def finished(self) -> bool:
        return sum(self.units_done.values()) == (self.total_steps - self.start_step) * self.workers
