"""BSP across cut replicas under `--workers MIN..MAX` (`--fsdp D`, over the collective transport; issue 28):
whole replicas of D workers join and leave a live run, HSDP across whichever replicas are there.

Slots are replicas: replica r's D workers are actor ranks r x D .. r x D + D - 1 (orchestrator/membership.py
places one group of D bundles per replica), and a worker lost takes its whole replica out
(orchestrator/controller/collective_scaling.py). The books are elastic BSP's (orchestrator/rounds.py) over
MAX x D slices a step: every worker takes one unit per round, so a round of R' replicas is R' x D units.

A re-form (`TrainWorker.reform` with `rebuilds_replica`): every member joins the new group, makes the
(R', D) mesh ("replicate", "shard") and a fresh trainer cut over it (FSDP2 cannot be moved to another
mesh), then puts its own pieces back (trainers/replica_shards.py `load_local`: D does not change, so
worker d's pieces keep their layout) and takes those of the source replica's worker d by a broadcast
over the mesh's "replicate" group: a joiner's worker d gets live worker d's model and optimizer
pieces, a plain copy of local tensors; a survivor that got a round further is brought back to the
source's round. Nothing is read from disk.

A round: FSDP reduces each gradient to the mean over the R' x D workers inside backward (a worker
sitting a round out with a placeholder unit runs its backward on a batch at weight 0, since FSDP's
collectives need every worker); one all-reduce of [w, w x lr, the gradient pieces' sum] then makes it
the mean over the units really there (x R'D / Σw), the rate elastic BSP's (`lr_factor` for Σw of
MAX x D slices), and finiteness one run-wide answer. A failed collective (a peer gone) raises
`GroupBroken` before anything is applied.

Checkpoints and evaluations come from one replica: its D workers evaluate the whole test set together
(worker d = 0 returns the scores) and gather the whole state (`whole_state`), so the driver writes the
layout-free checkpoint every reader takes; no worker writes checkpoint shards.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats, Strategy, StrategyContext
from distrain.strategies.elastic_group import GroupBroken, ReformedGroup, lr_factor
from distrain.strategies.sharded_bsp import SHARDED_COLUMNS, ShardedBSP, fsdp_bytes_per_step

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.trainers.sharded_trainer import ShardedTrainer


class ElasticShardedBSP(ReformedGroup, ShardedBSP):
    elastic = True
    metric_columns = SHARDED_COLUMNS | {"members": "int32"}  # members: the group's workers in the row's round
    rebuilds_replica = True  # a re-form makes a fresh trainer cut over the new mesh (TrainWorker.reform)
    sits_out_on_a_batch = True  # a placeholder round still runs FSDP's collectives (TrainWorker.run_segment)
    plan = Strategy.plan  # the units as dealt: slice = one of MAX x D (and the worker prefetches the next)
    codes_gradients = False  # its own way (`step`): FSDP across the live replicas; --compress is refused

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.weight = 0.0  # this worker's share of the round: 1 for a unit, 0 sitting one out
        self.mesh: Any = None
        self.live_replicas = 0

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        return config.segment_steps

    @property
    def slices_per_step(self) -> int:
        return self.config.worker_slots * self.shards  # MAX x D, whoever is there

    def setup(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        """No group yet: the driver forms one among the members (`reform`) before the first round."""

    def reformed(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        """After the re-form's copy (nothing of the strategy's own depends on the state)."""

    def cut(self, trainer: ShardedTrainer, size: int) -> Any:
        """After `reform`: the (R', D) mesh of this group's `size` workers, and `trainer` cut over it."""
        self.live_replicas = size // self.shards
        self.mesh = self.channel.device_mesh((self.live_replicas, self.shards, 1), ("replicate", "shard", "tp"))
        reshard = self.config.reshard_after_forward
        trainer.shard(self.mesh, reshard, across_replicas=True)
        self.traffic = fsdp_bytes_per_step(trainer.tp_numel * 4, self.live_replicas, self.shards, reshard)
        return self.mesh

    def compute_gradients(self, trainer: ShardedTrainer, batch: Any) -> float:  # type: ignore[override]
        self.weight = 1.0
        return self._backward(trainer, batch, 1.0)

    def sit_out_on(self, trainer: ShardedTrainer, batch: Any) -> None:
        """No unit for this worker in this round: FSDP's collectives still need its forward and backward,
        run on `batch` at weight 0 (a zero gradient)."""
        self.weight = 0.0
        self._backward(trainer, batch, 0.0)

    def _backward(self, trainer: ShardedTrainer, batch: Any, weight: float) -> float:
        try:
            return trainer.compute_gradients(batch, loss_weight=weight)
        except (RuntimeError, OSError) as e:  # FSDP's all-gather or reduce-scatter: a peer gone
            raise GroupBroken(str(e)) from e

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        import torch
        import torch.distributed as dist

        from distrain.trainers.sharded_trainer import local_part

        assert self.channel.joined, "reform() must run before step()"
        t0 = time.perf_counter()
        size = self.channel.world_size
        total = float(trainer.local_grad_sum())
        device = "cuda" if self.ctx.device.startswith("cuda") else "cpu"
        buffer = torch.tensor([self.weight, self.weight * lr, total], dtype=torch.float64, device=device)
        try:
            dist.all_reduce(buffer)
        except (RuntimeError, OSError) as e:
            raise GroupBroken(str(e)) from e
        units = int(round(float(buffer[0])))
        members = {"members": size}
        if units == 0:  # nobody had a unit (never dealt so): nothing to apply
            return CommStats(seconds=time.perf_counter() - t0, extra=self.layout_columns(trainer) | members)
        if units != size:  # FSDP's mean is over every worker; the placeholders' zeros are no samples
            for p in trainer.params:
                if p.grad is not None:
                    local_part(p.grad).mul_(size / units)
        c = self.config
        factor = lr_factor(units, self.slices_per_step, c.batch_size, c.base_batch_size, c.lr_scaling)
        rate = float(buffer[1]) / units * factor
        try:
            trainer.clip_gradient_(None)
        except (RuntimeError, OSError) as e:
            raise GroupBroken(str(e)) from e
        seconds = time.perf_counter() - t0
        applied = self.finite(bool(torch.isfinite(buffer[2])), "reduced gradient")
        if applied:
            trainer.apply_update(rate)
        return CommStats(
            seconds=seconds,
            bytes_sent=self.traffic,
            bytes_received=self.traffic,
            nonfinite=None if applied else True,
            lr=rate,
            extra=self.layout_columns(trainer) | members,
        )

    # ------------------------------------------------------------------ evaluation and state: one replica
    def eval_share(self, shard: int, num_shards: int) -> tuple[int, int]:
        """The share the driver asks for (an elastic run's: the whole test set, on one replica's D workers)."""
        return shard, num_shards

    def checkpoint_shards(self, trainer: ShardedTrainer, step: int, directory: Any) -> None:  # type: ignore[override]
        """No shards written: the driver writes the whole state one replica gathers (`export_state`)."""
        return None

    def export_state(self, trainer: ShardedTrainer) -> dict[str, Any]:  # type: ignore[override]
        """The replica's whole state, gathered by its D workers together; worker d = 0's is the answer."""
        from distrain.trainers.replica_shards import whole_state

        state = whole_state(trainer)
        return state if self.shard == 0 else {}
