"""Sandblaster across cut replicas (`--strategy sandblaster --fsdp D`; `Sandblaster.implementation` picks it).

The PS has exactly D shards and shard d holds FSDP chunk d of every tensor (trainers/shard_layout.py), as
under async, SSP and BSP over the PS across cut replicas (strategies/sharded_ps.py, whose set-up, pieces
and `_install` this reuses). The coordinator (strategies/sandblaster_coordinator.py) counts one client per
replica: a replica's D workers take each portion together.

- The task: worker 0 of the replica asks the coordinator (client id = the replica) and hands the task to
  its mates as an int64 tensor summed over the replica's group (`update_group`; -1: none left), so the D
  workers go through the same portions in the same order.
- θ of a pass: worker d reads its piece from PS shard d (`sb_point`) and installs it (`_install`). Whether
  the pass closed meanwhile (a shard answers None) is agreed: a MAX over the replica of a skip flag, so
  the D workers skip it together (FSDP's collectives need all D).
- Samples: the portion [lo, hi) is cut into D contiguous sub-ranges, data-parallel rank d taking
  sub-range d. FSDP's reduce-scatter leaves each worker the mean over the D workers of their summed
  gradients: multiplied by D, chunk d of the portion's summed gradient, bit for bit what it pushes. The
  loss sum and the count are summed over the replica's D workers, so every shard records the portion's.
- Push: worker d adds its chunk to shard d (`sb_add`); then every worker waits for its own push and the
  replica agrees (an all-reduce: a barrier) before worker 0 reports the portion finished, so the
  coordinator never closes a pass while a shard still misses a portion. Shards keep the first copy of a
  portion independently; copies are bit-identical (same θ, same samples, same D), so mixing replicas'
  copies across shards is exact.
- Checkpoints: θ as under the other PS strategies (`ShardedPS.export_state`: un-permuted, whole); the
  L-BFGS state (θ in float64, the (s, y) history, the last gradient and step) likewise un-permuted into
  the whole model's order (`extra_state`), so a checkpoint loads into a plain run and at another D.

Not yet: --tensor-parallel (the T workers of a data-parallel rank share samples: the loss and count would
be summed over D only, and a whole tensor's rows pushed per worker), pipelines, --workers MIN..MAX
(config/layout_section.py refuses them).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats
from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.sandblaster_common import COORDINATOR, SandblasterOptions
from distrain.strategies.sandblaster_common import SandblasterDeclarations as Sandblaster
from distrain.strategies.sandblaster_coordinator import SandblasterCoordinator
from distrain.strategies.sharded_bsp import SHARDED_COLUMNS
from distrain.strategies.sharded_ps import ShardedPS

if TYPE_CHECKING:
    from distrain.compression import CodecSpec
    from distrain.config import RunConfig
    from distrain.strategies.driver_actor import DriverActor
    from distrain.trainers.sharded_trainer import ShardedTrainer

KINDS = ("grad", "loss")


class ReplicaCoordinator(SandblasterCoordinator):
    """The coordinator of a cut run: its clients are the replicas, while the driver's notices (a lost
    worker, the straggler detector's verdict) name worker ranks, rank = replica x D + d."""

    def __init__(self, *args: Any, workers_per_replica: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.per_replica = workers_per_replica

    async def worker_lost(self, worker: int) -> int:
        return await super().worker_lost(worker // self.per_replica)

    async def mark_slow(self, workers: list[int]) -> None:
        await super().mark_slow(sorted({w // self.per_replica for w in workers}))


class ShardedSandblaster(ShardedPS):
    """Worker (r, d) of a cut replica under Sandblaster (the module docstring)."""

    name = "sandblaster"
    Options = SandblasterOptions
    full_batch = True
    reissues_lost_work = True
    compresses = ""
    elastic = False
    metric_columns = SHARDED_COLUMNS | Sandblaster.metric_columns

    def __init__(self, config: RunConfig, ctx: Any) -> None:
        super().__init__(config, ctx)
        assert COORDINATOR in ctx.driver_actors, "sandblaster needs the driver's coordinator"
        self.coordinator = ctx.driver_actors[COORDINATOR]
        self.held_pass = -1
        self.record: dict[str, Any] = {}
        self.comm_s = 0.0
        self.portions_done = 0
        self.sent = self.received = 0
        self.slowdown = config.stragglers.get(ctx.rank)

    # ------------------------------------------------------------------ as the unsharded strategy
    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        return Sandblaster.ps_rule(config)

    @classmethod
    def check_codec(cls, config: RunConfig, codec: CodecSpec) -> None:
        Sandblaster.check_codec(config, codec)

    @classmethod
    def driver_actors(cls, config: RunConfig) -> tuple[DriverActor, ...]:
        """The unsharded strategy's shards and coordinator, the coordinator counting replicas."""
        per_replica = config.replica_grid[0]

        def replica_coordinator(spec: DriverActor) -> DriverActor:
            args = spec.args
            return dataclasses.replace(
                spec, actor=ReplicaCoordinator, args=lambda setup: args(setup) | {"workers_per_replica": per_replica}
            )

        specs = Sandblaster.driver_actors(config)
        return tuple(replica_coordinator(s) if s.name == COORDINATOR else s for s in specs)

    @classmethod
    def actor_figures(cls, config: RunConfig, actors: dict[str, Any]) -> dict[str, Any]:
        return Sandblaster.actor_figures(config, actors)

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        return Sandblaster.summary_figures(steps)

    # ------------------------------------------------------------------ the replica's agreements
    def _sum(self, values: list[float], dtype: Any = None) -> list[float]:
        """`values` summed over the replica's D workers (its group)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=dtype or torch.float64)
        with self._inside_replica():
            dist.all_reduce(t, group=self.update_group)
        return t.tolist()

    def _agree_task(self, task: Any) -> tuple[int, ...] | None:
        """Worker 0's task (None: the iteration is over), the same on its D mates."""
        import torch

        code = [-1] * 5
        if self.piece == 0 and task is not None:
            code = [task.pass_id, KINDS.index(task.kind), task.portion, task.of, int(task.copy)]
        elif self.piece != 0:
            code = [0] * 5
        agreed = [int(v) for v in self._sum(code, torch.int64)]
        return None if agreed[0] < 0 else tuple(agreed)

    def _agree_skip(self, skip: bool) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if skip else 0], dtype=torch.int64)
        with self._inside_replica():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.update_group)
        return bool(flag.item())

    # ------------------------------------------------------------------ one outer iteration
    def run_unit(self, trainer: ShardedTrainer, reader: Any, global_step: int) -> tuple[float, int]:  # type: ignore[override]
        import numpy as np
        import ray

        n = len(reader.dataset)
        samples, finished, comm = 0, None, 0.0
        self.portions_done, self.sent, self.received = 0, 0, 0
        shard = self.ctx.ps_shards[self.piece]
        while True:
            t0 = time.perf_counter()
            task = None
            if self.piece == 0:
                task = ray.get(self.coordinator.acquire.remote(self.replica, finished, global_step))
            finished = None
            agreed = self._agree_task(task)
            if agreed is None:
                comm += time.perf_counter() - t0
                break
            pass_id, kind, portion, of, copy = agreed
            if pass_id != self.held_pass:
                point = ray.get(shard.sb_point.remote(pass_id))
                if self._agree_skip(point is None):
                    comm += time.perf_counter() - t0
                    continue  # that pass closed while we asked (a copy no longer needed)
                self.theta.numpy()[:] = point
                self._install()
                self.held_pass = pass_id
                self.received += self.ps_bytes
            comm += time.perf_counter() - t0
            lo, hi = portion * n // of, (portion + 1) * n // of
            a, b = lo + (hi - lo) * self.shard // self.shards, lo + (hi - lo) * (self.shard + 1) // self.shards
            batch = reader.read(np.arange(a, b))
            grad = KINDS[kind] == "grad"
            started = time.perf_counter()
            loss_sum, count = self._portion_sums(trainer, batch, grad)
            if self.slowdown:  # --straggler: this worker (and so its replica) is slow at every portion
                time.sleep(self.slowdown.extra_s(time.perf_counter() - started))
            total_loss, total_count = self._sum([loss_sum, float(count)])
            g = None
            if grad:  # FSDP's mean over the D workers' summed gradients, chunk d: x D is the portion's sum
                g = (self._local_gradient(trainer) * self.shards).numpy()
            t0 = time.perf_counter()
            push = shard.sb_add.remote(self.replica, pass_id, portion, g, total_loss, int(total_count))
            ray.get(push)  # in shard d before worker 0 reports the portion finished (the barrier below)
            self._sum([0.0])
            finished = (pass_id, portion, bool(copy), [push]) if self.piece == 0 else None
            comm += time.perf_counter() - t0
            self.sent += self.ps_bytes if grad else 0
            samples += count
            self.portions_done += 1
        t0 = time.perf_counter()
        self.record = ray.get(self.coordinator.record.remote(global_step))
        self.comm_s = comm + time.perf_counter() - t0
        return float(self.record["loss"]), samples

    def _portion_sums(self, trainer: ShardedTrainer, batch: Any, with_gradient: bool) -> tuple[float, int]:
        """As `LocalTrainer.portion_sums` on this worker's part of the portion: the loss summed over it in
        eval mode, and with `with_gradient` FSDP's reduce-scatter of the summed gradients (their mean over
        the replica's D workers) in this worker's chunks. Every worker of the replica calls it."""
        import torch

        from distrain.trainers.task import to_device

        batch = to_device(batch, trainer.device)
        count = trainer.task.batch_size(batch)
        with self._inside_replica():
            if not with_gradient:
                with torch.no_grad():
                    return float(trainer.task.deterministic_loss(trainer.model, batch)) * count, count
            assert trainer.optimizer is not None
            trainer.optimizer.zero_grad(set_to_none=True)
            loss = trainer.task.deterministic_loss(trainer.model, batch)
            (loss * count).backward()
        return float(loss.detach()) * count, count

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        r = self.record
        return CommStats(
            seconds=self.comm_s,
            bytes_sent=self.sent,
            bytes_received=self.received,
            extra={k: r.get(k) for k in Sandblaster.metric_columns if k in r}
            | {"portions_done": self.portions_done}
            | self.layout_columns(trainer),
        )

    def prepare_eval(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        super().prepare_eval(trainer)
        self.held_pass = -1  # the parameters now hold the shards' θ, not a pass's point

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any] | None:
        """The shards' L-BFGS state un-permuted into the whole model's order (one entry, as a plain run with
        one shard writes it), and the coordinator's counters."""
        import ray

        from distrain.strategies.sandblaster_common import _convert, join_states

        parts = ray.get([s.sb_call.remote("state") for s in self.ctx.ps_shards])
        whole = join_states(parts, self.layout.from_shards)
        return {"shards": _convert([whole], "torch"), "coordinator": ray.get(self.coordinator.state.remote())}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        import ray

        from distrain.strategies.sandblaster_common import _convert, join_states, split_state

        if self.ctx.rank != 0:  # one worker restores the shared state
            return
        whole = join_states(_convert(state["shards"], "numpy"), None)
        parts = split_state(whole, self.ctx.ps_bounds, self.layout.to_shards)
        ray.get([s.sb_call.remote("load", part) for s, part in zip(self.ctx.ps_shards, parts, strict=True)])
        ray.get(self.coordinator.load_state.remote(state["coordinator"]))
