"""BSP across sharded replicas (`--fsdp D`, `BSP.implementation` picks it): HSDP with torch's FSDP2.

R x D worker actors; actor rank = replica x D + shard, and data-parallel rank (replica, shard) takes
slice replica x D + shard of each step's R x D x B samples (the default work plan: slice = rank). The
run's device mesh is (R, D) = ("replicate", "shard"); `fully_shard` over it (trainers/sharded_trainer.py)
all-gathers each layer's parameters inside the replica before the layer runs, reduce-scatters its
gradient inside the replica, and all-reduces the gradient shards across the R replicas. Every worker
then holds the mean gradient over all R x D batches for its own shard and steps its own optimizer on
it: the update BSP makes on the global batch, with 1/D of the state in each worker.

FSDP's collectives run inside forward and backward, on the run's process group but not through the
channel's calls, so a row's bytes are the model's (per rank and step: all-gather in forward and, with
--reshard-after-forward, again in backward, (D-1)/D x the parameter bytes each; reduce-scatter (D-1)/D;
across replicas 2(R-1)/R x the shard's bytes) and its comm seconds are the run-wide finiteness check's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats, Strategy, StrategyContext

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.trainers.sharded_trainer import ShardedTrainer

SHARDED_COLUMNS = {
    "replica": "int32",
    "shard": "int32",  # the worker's place within its replica (0..D-1)
    "mem_param_bytes": "int64",  # parameter bytes this worker holds: its shards
    "mem_grad_bytes": "int64",
    "mem_optim_bytes": "int64",
}


def fsdp_bytes_per_step(param_bytes: int, replicas: int, shards: int, reshard_after_forward: bool) -> int:
    """Bytes one worker sends (and receives) per step under HSDP: all-gathers and a reduce-scatter of
    (D-1)/D x the parameter bytes each (two all-gathers when parameters are freed after the forward),
    then a ring all-reduce of its 1/D shard across the R replicas."""
    gathers = 2 if reshard_after_forward else 1
    inside = (gathers + 1) * (shards - 1) * param_bytes // shards
    across = 2 * (replicas - 1) * (param_bytes // shards) // replicas
    return inside + across


class ShardedBSP(Strategy):
    name = "bsp"
    metric_columns = SHARDED_COLUMNS

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.shards = config.replica_size  # D (a sharded replica has no pipeline stages)
        self.replicas = ctx.world_size // self.shards
        self.replica, self.shard = divmod(ctx.rank, self.shards)
        self.whole: dict[str, Any] | None = None

    def setup(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        self.channel.join()
        if self.replicas > 1:
            mesh = self.channel.device_mesh((self.replicas, self.shards), ("replicate", "shard"))
        else:
            mesh = self.channel.device_mesh((self.shards,), ("shard",))
        trainer.shard(mesh, self.config.reshard_after_forward)
        self.traffic = fsdp_bytes_per_step(
            trainer.numel * 4, self.replicas, self.shards, self.config.reshard_after_forward
        )

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        import torch.distributed as dist

        t0 = time.perf_counter()
        # Every worker holds a different shard: the sum over all of them decides for all (a NaN or inf
        # anywhere makes it so), so the R x D workers skip, or stop, together.
        total = trainer.local_grad_sum()
        dist.all_reduce(total)
        seconds = time.perf_counter() - t0
        applied = self.finite(bool(total.isfinite()), "all-reduced gradient")
        if applied:
            trainer.apply_update(lr)
        extra = {
            "replica": self.replica,
            "shard": self.shard,
            "mem_param_bytes": trainer.nbytes,
            "mem_grad_bytes": trainer.grad_bytes(),
            "mem_optim_bytes": trainer.optimizer_bytes(),
        }
        return CommStats(
            seconds=seconds,
            bytes_sent=self.traffic,
            bytes_received=self.traffic,
            nonfinite=None if applied else True,
            extra=extra,
        )

    # ------------------------------------------------------------------ evaluation
    def eval_share(self, shard: int, num_shards: int) -> tuple[int, int]:
        """A replica's D workers score the same share of the test set (each forward gathers the layers
        from all of them); replica r takes share r of R."""
        return self.replica, self.replicas

    def evaluate(self, trainer: ShardedTrainer, batches: Iterable[Any]) -> dict[str, tuple[float, float]]:  # type: ignore[override]
        """Every worker of the replica runs the forward passes; its first worker's scores count."""
        totals = trainer.evaluate(batches)
        return totals if self.shard == 0 else {}

    # ------------------------------------------------------------------ state
    def at_epoch_end(self, trainer: ShardedTrainer) -> CommStats | None:  # type: ignore[override]
        """Gather the whole model and optimizer state (every worker takes part); rank 0, which the driver
        asks for checkpoints, keeps it: checkpoints restore at any layout."""
        t0 = time.perf_counter()
        whole = trainer.whole_state()
        self.whole = whole if self.ctx.rank == 0 else None
        return CommStats(seconds=time.perf_counter() - t0)

    def export_state(self, trainer: ShardedTrainer) -> dict[str, Any]:  # type: ignore[override]
        if self.whole is None:
            raise RuntimeError("a sharded replica's state is gathered at period ends; none has been reached yet")
        return self.whole
