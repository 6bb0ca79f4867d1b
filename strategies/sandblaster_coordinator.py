"""Sandblaster's coordinator: cuts every data pass into portions, and drives the batch optimiser.

Hosted by the driver as a Ray async actor (`Sandblaster.driver_actors` declares it as a spec, after the
shards it is built with; the workers reach it as `ctx.driver_actors["sandblaster_coordinator"]`).
It never holds a vector: the shards hold θ, the accumulators and the L-BFGS history
(`lbfgs.ShardState`), and the coordinator only sends them commands and adds up the scalars they return
(loss sums, squared norms, their slices' Gram matrices).

A pass is either a gradient pass (summed loss and gradient at θ) or a loss pass (summed loss at a line
search's trial point). Its P = --tasks-per-pass portions go to workers as they ask (fast workers take
more); with --backup-tasks, once none is left to hand out, an idle worker gets a copy of an outstanding
portion, and a worker reported lost (`worker_lost`) gives its outstanding portions back to the front of the
queue: the pass's `PortionQueue` (strategies/portion_queue.py), handed out as the backup tasks' scheduler
hands out a round's (both are a `PortionHandout`, strategies/portion_scheduler.py).
The shards count each portion once, whichever copy arrives first; the pass closes when every portion has
been taken by every shard.

One outer iteration (= one global step of the run):
- gd: a gradient pass, then θ ← θ − η·g.
- lbfgs: a gradient pass (which also forms the newest pair (s, y) from the last step, or skips it),
  the direction from one round of Gram matrices, then loss passes for backtracking Armijo from t = 1
  (the first iteration, with no history, from t = min(1, 1/‖g‖)), then θ ← θ + t·d.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from distrain.strategies.lbfgs import Armijo, direction_coefficients, keep_pair
from distrain.strategies.portion_queue import PortionQueue
from distrain.strategies.portion_scheduler import PortionHandout


@dataclass(frozen=True)
class PortionTask:
    pass_id: int
    kind: str  # "grad" | "loss"
    portion: int
    of: int  # the pass's portions (--tasks-per-pass): this one is `portion` of `of`
    iteration: int
    copy: bool  # a backup copy of a portion another worker holds


class ShardCalls:
    """The shards as the coordinator reaches them: `call(method, *args)` runs one `ShardState` method on
    every shard (Ray actors through `sb_call`), results in shard order."""

    def __init__(self, shards: list[Any]) -> None:
        self.shards = shards

    async def call(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(s.sb_call.remote(method, *args) for s in self.shards)))


class LocalShards(ShardCalls):
    """`lbfgs.ShardState` objects in this process (tests, and one-process runs of the algorithm)."""

    async def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(s, method)(*args) for s in self.shards]


class SandblasterCoordinator(PortionHandout):
    def __init__(
        self,
        shards: Any,
        batch_optimizer: str,
        tasks_per_pass: int,
        copies: bool,
        lr: float,
        start_iteration: int = 0,
        line_search_trials: int = 20,
    ) -> None:
        super().__init__()
        # Ray actor handles arrive as a list; tests hand a ShardCalls (e.g. LocalShards) directly.
        self.shards = shards if isinstance(shards, ShardCalls) else ShardCalls(list(shards))
        self.method = batch_optimizer
        self.per_pass = tasks_per_pass
        self.copies = copies  # --backup-tasks: copy a pass's outstanding portions to idle workers
        self.lr = lr
        self.trials = line_search_trials
        self.iteration = start_iteration
        self.records: dict[int, dict[str, Any]] = {}
        self.totals = {
            "data_passes": 0,
            "grad_passes": 0,
            "loss_passes": 0,
            "portions_issued": 0,
            "portions_reissued": 0,
            "backups_used": 0,
        }
        self.pass_id = 0
        self._new_iteration()
        self._open("grad")

    # ------------------------------------------------------------------ passes and portions
    def _new_iteration(self) -> None:
        self.it = {"reissued": 0, "backups_used": 0, "passes": 0, "evals": 0}
        self.search: Armijo | None = None

    def _open(self, kind: str) -> None:
        """Hand out the portions of a new pass (the shards have already opened it)."""
        self.kind = kind
        self.queue = PortionQueue(self.per_pass)
        self.closing = False

    async def start(self) -> None:
        """Open the first pass on the shards (the actor's creator calls this once)."""
        await self.shards.call("open_pass", self.pass_id, self.kind)

    async def acquire(self, worker: int, finished: tuple[Any, ...] | None, upto: int) -> PortionTask | None:
        """The next portion for `worker`, or None once iterations up to `upto` are complete.

        `finished` = (pass_id, portion, copy, refs of its pushes to the shards) reports the portion the
        worker just pushed; it is done once every shard has taken it (meanwhile the worker goes on).
        """
        if finished is not None:
            pass_id, portion, copy, pushes = finished
            self._background(self._complete_when_pushed(pass_id, portion, copy, pushes))
        async with self.changed:
            while self.iteration <= upto:
                task = self._next_for(worker)
                if task is not None:
                    return task
                await self.changed.wait()
            return None

    def _next_for(self, worker: int) -> PortionTask | None:
        if self.closing:
            return None
        taken = self.queue.next_for(worker, self.slow, copies=self.copies)
        if taken is None:
            return None
        portion, copy = taken
        self.it["reissued"] += copy
        self.totals["portions_issued"] += 1
        return PortionTask(self.pass_id, self.kind, portion, self.per_pass, self.iteration, copy)

    async def _complete_when_pushed(self, pass_id: int, portion: int, copy: bool, pushes: list[Any]) -> None:
        # The shards' record counts a portion once however many of them a dead pusher's push reached.
        verdicts = await self._pushed(pushes) if pushes else [True]
        if verdicts is not None:
            await self.complete(pass_id, portion, copy, bool(verdicts[0]))

    async def complete(self, pass_id: int, portion: int, copy: bool, counted: bool) -> None:
        """Portion `portion` of pass `pass_id` is in every shard (`counted`: this copy was the one kept)."""
        async with self.changed:
            if pass_id != self.pass_id or not self.queue.complete(portion):
                return  # a pass already closed, or a copy whose twin was first
            if counted and copy:
                self.it["backups_used"] += 1
            if self.queue.all_done and not self.closing:
                self.closing = True
                self._background(self._close())

    def _gave_back(self, count: int) -> None:
        self.it["reissued"] += count  # this iteration's figure, as backup copies count

    # ------------------------------------------------------------------ the optimiser
    async def _close(self) -> None:
        """Every portion of the pass is in: take the optimiser's next move, then open the next pass."""
        self.it["passes"] += 1
        self.totals["data_passes"] += 1
        self.totals[f"{self.kind}_passes"] += 1
        if self.kind == "grad":
            next_kind = await self._after_gradient()
        else:
            next_kind = await self._after_loss()
        self.pass_id += 1
        await self.shards.call("open_pass", self.pass_id, next_kind)
        async with self.changed:
            self._open(next_kind)
            self.changed.notify_all()

    def _finish_iteration(self, step_length: float) -> None:
        record = dict(self.current)
        record |= {
            "step_length": step_length,
            "line_search_evals": self.it["evals"],
            "iteration_passes": self.it["passes"],
            "data_passes": self.totals["data_passes"],
            "portions_reissued": self.it["reissued"],
            "backups_used": self.it["backups_used"],
        }
        self.totals["portions_reissued"] += self.it["reissued"]
        self.totals["backups_used"] += self.it["backups_used"]
        self.records[self.iteration] = record
        self.iteration += 1
        self._new_iteration()

    async def _after_gradient(self) -> str:
        # Every shard sums the same portions' losses (each counts a portion once): shard 0's is the loss.
        parts = await self.shards.call("close_grad")
        f = parts[0]["loss_sum"] / parts[0]["count"] + sum(p["reg"] for p in parts)
        gnorm = math.sqrt(sum(p["gg"] for p in parts))
        self.current = {"loss": f, "grad_norm": gnorm}
        if self.method == "gd":
            await self.shards.call("gd_step", self.lr)
            self._finish_iteration(self.lr)
            return "grad"
        pair = await self.shards.call("form_pair")
        if pair[0]:
            ys, yy, ss = (sum(p[k] for p in pair) for k in ("ys", "yy", "ss"))
            await self.shards.call("keep_pair", keep_pair(ys, yy, ss))
        m = (await self.shards.call("history_length"))[0]
        gram = sum(await self.shards.call("gram"))
        delta = direction_coefficients(gram, m)
        slope = float(delta @ gram[:, 2 * m])  # gᵀd
        if not slope < 0:  # round-off made H indefinite: start the history over, steepest descent
            await self.shards.call("clear_history")
            m, gram = 0, np.array([[gnorm * gnorm]])
            delta = direction_coefficients(gram, 0)
            slope = -gnorm * gnorm
        await self.shards.call("set_direction", delta)
        t0 = 1.0 if m else min(1.0, 1.0 / gnorm) if gnorm > 0 else 1.0
        self.search = Armijo(f, slope, t0, self.trials)
        await self.shards.call("set_trial", t0)
        return "loss"

    async def _after_loss(self) -> str:
        assert self.search is not None
        parts = await self.shards.call("close_loss")
        f_t = parts[0]["loss_sum"] / parts[0]["count"] + sum(p["reg"] for p in parts)
        self.it["evals"] += 1
        verdict = self.search.judge(f_t)
        if verdict == "accept":
            await self.shards.call("accept", self.search.t)
            self._finish_iteration(self.search.t)
            return "grad"
        if verdict == "give_up":
            await self.shards.call("reject")
            self._finish_iteration(0.0)
            return "grad"
        await self.shards.call("set_trial", self.search.t)
        return "loss"

    # ------------------------------------------------------------------ reading and checkpoints
    async def record(self, iteration: int) -> dict[str, Any]:
        """The figures of a finished iteration (waits for it)."""
        async with self.changed:
            await self.changed.wait_for(lambda: iteration in self.records)
            return dict(self.records[iteration])

    async def wait_iteration(self, iteration: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.iteration > iteration)

    def stats(self) -> dict[str, int]:
        return dict(self.totals) | {"iterations": len(self.records)}

    def state(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.totals.update(state.get("totals", {}))
