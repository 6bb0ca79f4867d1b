"""Backup tasks (`--strategy bsp --transport ps --backup-tasks`) across cut replicas (`--fsdp D`, a fixed
number of replicas; `BSP.implementation` picks it): the portion scheduler (strategies/portion_scheduler.py)
hands a round's chunks of portions to replicas, not workers, and the D workers of a replica take each
chunk together (strategies/backup_tasks.py for the plain feature, strategies/sharded_ps.py for how a cut
replica meets the PS).

- One request a replica: its worker (0, 0) asks the scheduler (client id = the replica) and hands the
  assignment to its mates (`_agree_task`: an int64 all-reduce over the replica's `update_group`, the
  others adding zeros; -1 = the segment's rounds are through), so all D take the same chunk or all stop.
- θ of the chunk's round: each worker pulls its piece at PS shard d at the round's tag (`pull_at`). Its
  shard may already be a round further (the round closed while the replica was sent to help): the
  replica agrees, with one MAX all-reduce of (the furthest version, - the nearest), to skip the chunk if
  any of its D shards is past the tag, and on the version it holds (the nearest), so a later chunk of
  the same round does not pull again, and never computes on chunks of different versions.
- Samples: a chunk of c portions from p is the step's samples [p, p + c) x B / P; data-parallel rank d
  reads the d-th of its D equal contiguous parts (slices (p x D + d x c) .. + c of the step's P x D
  equal slices; config/layout_section.py requires B divisible by P x D). FSDP's reduce-scatter leaves
  each worker chunk d of the replica's mean gradient over the chunk's samples: the chunk's mean, which is
  what a plain worker pushes (the shards weigh a chunk by its portions), so nothing is rescaled.
- Push: worker d pushes its piece to shard d alone (`push_portion`: the shard keeps the first copy of a
  portion and drops the others). Before worker (0, 0) reports the chunk done, every worker waits for
  its own push's verdict and the replica all-reduces (a barrier, `_all_pushed`): the scheduler counts the
  chunk done only once every shard has it, and never closes a round while a shard misses a portion.
  Shards keep copies independently: shard 0 may keep replica 0's copy of a chunk and shard 1 replica 1's.
  Both were computed on the same θ and samples (bit-identical on the same hardware, and the same
  gradient in any case), so the mixed update is the round's mean gradient.
- Rows: one per portion (`backup_tasks.per_portion`), slice = portion x D + d, so (epoch, step, slice)
  stays unique per worker row; `dropped` is this worker's own shard's verdict (copies are dropped per
  shard, and the replica's rows may differ there when the shards kept different replicas' copies).
- Checkpoints: the shards' snapshot un-permuted (`ShardedPS.export_state`): whole, loads at any layout.

A non-finite gradient piece, or fp16's overflow, is agreed over the replica: its D workers push nothing
for the chunk together (it counts as done with nothing, as a plain worker's). Not yet: --tensor-parallel,
--workers MIN..MAX, --pipeline-stages (config/layout_section.py refuses them); --compress is refused as
for plain backup tasks (a portion's gradient goes out whole). Unlike the plain worker, a replica does not
ask for the next round's θ with its push: it pulls at a new round's first chunk.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ray

from distrain.compression.spec import FLAG
from distrain.errors import ConfigError
from distrain.strategies.backup_tasks import per_portion
from distrain.strategies.base import CommStats, StrategyContext
from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.portion_scheduler import Assignment
from distrain.strategies.sharded_ps import ShardedBSPOverPS

if TYPE_CHECKING:
    from distrain.compression import CodecSpec
    from distrain.config import RunConfig
    from distrain.trainers.sharded_trainer import ShardedTrainer

FIELDS = 6  # an assignment as ints: epoch, step, portion, tag, copy, count (-1: none left, -2: still waiting)
WAIT_S = 10.0  # the lead's longest wait for the scheduler between two words to its mates


class ShardedBackupTasks(ShardedBSPOverPS):
    """Worker (r, d) of a cut replica taking the portion scheduler's chunks with its mates (module docstring)."""

    compresses = ""
    elastic = False  # --workers MIN..MAX: refused (config/layout_section.py)

    @classmethod
    def check_codec(cls, config: RunConfig, codec: CodecSpec) -> None:
        raise ConfigError(f"{FLAG} does not apply to --backup-tasks portions; drop {FLAG} {codec} or the backup tasks")

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        portions = config.options_of("bsp").portions
        assert portions is not None
        return ConsistencyRule.backup_tasks(portions)

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        assert "portion_scheduler" in ctx.driver_actors, "backup tasks need the driver's portion scheduler"
        self.scheduler = ctx.driver_actors["portion_scheduler"]
        self.lead = self.shard == 0 and self.tp_rank == 0  # the replica's worker (0, 0): it talks to the scheduler
        self.held = -1  # shard version of the θ this replica holds (agreed); -1: none pulled by `plan` yet
        self.current: Assignment | None = None
        self.next_request: Any = None  # (lead) the request for the next chunk, sent with the last report
        self.upto: tuple[int, int] = (0, 0)
        self.waited = 0.0
        self.received = 0
        self.in_flight: list[tuple[bool, int, int]] = []  # this segment's chunks: (counted here, first portion, count)

    @property
    def portions(self) -> int:
        assert self.options.portions is not None
        return self.options.portions

    @property
    def slices_per_step(self) -> int:
        """P portions, each cut into D equal parts (data-parallel rank d reads part d of its chunk)."""
        return self.portions * self.shards

    def unit_slices(self, slice_: int) -> range:
        """The chunk being computed, this worker's part: slice_ = portion x D + d (`plan`), and rank d of a
        chunk of c portions reads the d-th of its D contiguous parts, c slices of the P x D."""
        assert self.current is not None
        count = self.current.count
        start = self.current.portion * self.shards + self.shard * count
        return range(start, start + count)

    # ------------------------------------------------------------------ the replica agrees
    def _replica_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of `values` over the replica's D x T workers."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        with self._inside_replica():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.update_group)
        return [int(v) for v in t]

    def _agree_task(self) -> Assignment | None:
        """The lead's next assignment, the same on every worker of the replica (None: the segment is through)."""
        import torch
        import torch.distributed as dist

        # The scheduler answers once the round has something for this replica, which may take a round's
        # time: the lead tells its mates every WAIT_S that it is still waiting (-2), so they never sit in
        # one all-reduce past --collective-timeout-s.
        wait_s = min(WAIT_S, self.config.collective_timeout_s / 4)
        while True:
            t = torch.zeros(FIELDS, dtype=torch.int64)
            if self.lead:
                if self.next_request is None:
                    self.next_request = self._request(None)
                ready, _ = ray.wait([self.next_request], timeout=wait_s)
                if not ready:
                    t[:] = -2
                else:
                    a = ray.get(self.next_request)
                    self.next_request = None
                    t[:] = -1 if a is None else torch.tensor([a.epoch, a.step, a.portion, a.tag, int(a.copy), a.count])
            with self._inside_replica():
                dist.all_reduce(t, group=self.update_group)  # the lead's values; the mates add zeros
            epoch, step, portion, tag, copy, count = (int(v) for v in t)
            if count == -2:
                continue
            if count < 0:
                return None
            return Assignment(epoch, step, portion, tag, bool(copy), count)

    def _request(self, finished: tuple[int, int, list[Any]] | None) -> Any:
        return self.scheduler.acquire.remote(self.replica, finished, *self.upto)

    # ------------------------------------------------------------------ the units
    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        """The replica's chunks from the scheduler until the segment's last round is through."""
        if not units:
            return
        self.upto = units[-1][0], units[-1][1]
        self.in_flight = []
        while True:
            t0 = time.perf_counter()
            assignment = self._agree_task()
            if assignment is None:
                return
            self.waited, self.received = time.perf_counter() - t0, 0
            if assignment.tag > self.held:
                waited, versions = self.client.pull_at(assignment.tag, self.theta.numpy())
                self.waited += waited
                self.received = self.ps_bytes
                furthest, nearest = self._replica_max([max(versions), -min(versions)])
                self.held = -nearest
                self._install()
                if furthest > assignment.tag:
                    # The round closed while we were sent to help (some shard already applied it): the
                    # replica's θ may mix two versions, so computing on it is pointless at best.
                    self.held = -1
                    continue
            self.current = assignment
            yield assignment.epoch, assignment.step, assignment.portion * self.shards + self.shard

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        a = self.current
        assert a is not None
        t0 = time.perf_counter()
        trainer.unscale_grads_()  # --precision fp16: the replica's gradient, divided by the loss scale
        with self._inside_replica():
            trainer.clip_gradient_(self.update_group)  # --clip-grad-norm: the replica's chunk gradient
        grads = self._local_gradient(trainer)
        ok = bool(grads.sum().isfinite()) and math.isfinite(trainer.last_loss)
        # The replica's D workers push the chunk or skip it together: a piece at one shard and none at the
        # other would leave that shard's round short (or its chunk counted at one shard only).
        (bad,) = self._replica_max([0 if ok else 1])
        ok = self.gradient_decision(trainer.scaler, bad == 0, "loss or gradient")
        pushes = self.client.push_portion_async(a.tag, a.portion, grads.numpy() if ok else None, lr, a.count)
        counted = self._all_pushed(pushes)
        if self.lead:
            self.next_request = self._request((a.tag, a.portion, pushes))
        self.in_flight.append((counted, a.portion, a.count))
        extra = self.layout_columns(trainer)
        return CommStats(
            seconds=time.perf_counter() - t0 + self.waited,
            bytes_sent=self.traffic + self.ps_bytes,  # FSDP's inside the replica, then the push
            bytes_received=self.traffic + self.received,
            wait_s=self.waited,
            read_version=a.tag,
            applied_version=a.tag,  # settled: None where this worker's shard kept another copy
            lag=0,
            backup=a.copy,
            nonfinite=None if ok else True,
            extra=extra,
        )

    def _all_pushed(self, pushes: list[Any]) -> bool:
        """Wait for this worker's push to its shard and for its mates' (a barrier over the replica), so the
        chunk reported done is at every shard; whether this worker's shard kept this copy."""
        counted = bool(ray.get(pushes[0], timeout=self.client.timeout_s))
        self._replica_max([0])
        return counted

    def settle(self, rows: dict[str, list[Any]]) -> None:
        """Mark the copies this worker's shard dropped, and cut each chunk's row into one per portion with
        slice = portion x D + d."""
        for i, (counted, portion, _) in enumerate(self.in_flight):
            rows["dropped"][i] = not counted
            if not counted:
                rows["applied_version"][i] = None
            rows["slice"][i] = portion  # per_portion counts portions up from it
        counts = [count for _, _, count in self.in_flight]
        per_portion(rows, counts)
        split = sum(counts)  # the chunks' rows (a row after them: --on-nonfinite stop's, already a slice)
        rows["slice"][:split] = [s * self.shards + self.shard for s in rows["slice"][:split]]
        self.in_flight = []
