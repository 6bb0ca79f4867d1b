"""Pipelines of cut stages: BSP over R replicas of a model cut into S stages, each stage's module split
T ways by its tensor-parallel plan and sharded D ways by FSDP2 (`--pipeline-stages S` with `--fsdp D`
and/or `--tensor-parallel T`; BSP.implementation picks it).

R x S x D x T worker actors; actor rank = ((replica x S + stage) x D + shard) x T + tp
(trainers/grid_position.py): a stage's T tensor-parallel workers are neighbours, then its D shards, then
a replica's S stages. Each worker builds its stage (trainers/pipeline_split.py, the full model's
parameter names kept), applies the plan's entries for the layers in that stage over the mesh's "tp"
dimension, and `fully_shard`s it over the run's device mesh (R, S, D, T) = ("replicate", "stage",
"shard", "tp") sliced to ("replicate", "shard"): its stage's D shards in every replica, HSDP as
ShardedBSP's (trainers/sharded_trainer.py).

Tensor parallelism across a stage boundary needs no extra step: torch's Colwise/RowwiseParallel hand
plain local tensors in and out (`use_local_output`), so a colwise layer ending stage s gives TP rank t
its slice of the features and sends it to TP rank t of stage s + 1, whose rowwise layer expects just
that slice (a pipeline is one shard and one TP rank of every stage: the mesh's "stage" dimension). The
cnn's hybrid plan (each TP worker on its own samples) is refused with stages (config/layout_section.py).

A replica is D pipelines side by side: shard d of every stage forms one pipeline (the mesh's "stage"
dimension, a group of S workers whose group rank is the stage, as torch's PipelineStage needs), feeding
data-parallel rank (replica, d)'s slice replica x D + d of each step's R x D x B samples as M
micro-batches through torch's ScheduleGPipe or Schedule1F1B (PipelineBSP's machinery: the per-stage
timings, spans and p2p bytes). Shard d of stage s sends to shard d of stage s + 1 only, while each
stage's parameters are gathered over its D shards. torch's schedule switches the stage's FSDP gradient
sync off for every micro-batch's backward and reduce-scatters once after the last
(`_PipelineStageBase.backward_maybe_with_nosync` / `perform_reduce_grad`), then divides by M: each
worker ends the step with its shard of the mean gradient over all R x D slices, the update BSP makes on
the global batch, with 1/(S x D) of the state in each worker.

Checkpoints: every worker writes its stage's shards through DCP, as ShardedBSP's do (its
`checkpoint_shards`); the stage modules keep the full model's names, so the entries of all stages make
one whole-model checkpoint that any layout (or one process) reads back. Rank 0 hands the driver the
reference with the whole model's keys, gathered from its pipeline's stages at set-up.

Not built: elastic membership and strategies other than BSP (pipelines are BSP-only, config/strategy_section.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from distrain.strategies.activation_meter import ActivationMeter
from distrain.strategies.base import CommStats, StrategyContext
from distrain.strategies.pipeline import PIPELINE_COLUMNS, PipelineBSP
from distrain.strategies.sharded_bsp import ShardedBSP, fsdp_bytes_per_step
from distrain.trainers.grid_position import grid_position

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.trainers.sharded_trainer import ShardedTrainer

SHARDED_PIPELINE_COLUMNS = PIPELINE_COLUMNS | {
    "shard": "int32",  # the worker's FSDP rank within its stage (0..D-1)
    "ckpt_block_s": "float64",  # seconds a checkpoint's save blocked this worker (steps a checkpoint follows)
}


class ShardedPipelineBSP(PipelineBSP):
    """`bsp` with --pipeline-stages S >= 2 and --fsdp D >= 2 and/or --tensor-parallel T >= 2."""

    metric_columns = SHARDED_PIPELINE_COLUMNS

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.shards, self.tp, _ = config.replica_grid
        self.replicas = ctx.world_size // (self.stages * self.shards * self.tp)
        where = grid_position(ctx.rank, self.shards, self.tp, self.stages)
        self.replica, self.stage, self.shard, self.tp_rank = where.replica, where.stage, where.shard, where.tp
        self.data_rank = where.data_rank(self.shards)
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.saved: dict[str, Any] | None = None  # the last checkpoint begun (ShardedBSP.checkpoint_shards)

    @property
    def slices_per_step(self) -> int:
        return self.replicas * self.shards

    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        # The S stages of shard d in replica r all read data-parallel rank (r, d)'s slice (its T
        # tensor-parallel workers too: they share it).
        for epoch, step, _ in units:
            yield epoch, step, self.data_rank

    def pipeline_ranks(self) -> list[int]:
        """The run ranks of this worker's pipeline: shard `shard`, TP rank `tp_rank` of each of its replica's
        stages."""
        R, S, D, T = self.replica, self.stages, self.shards, self.tp
        return [((R * S + s) * D + self.shard) * T + self.tp_rank for s in range(S)]

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        import torch.distributed as dist

        from distrain.trainers.sharded_checkpoint import AsyncSaver

        self.channel.join()
        S, D, T, R = self.stages, self.shards, self.tp, self.replicas
        mesh = self.channel.device_mesh((R, S, D, T), ("replicate", "stage", "shard", "tp"))
        reshard = self.config.reshard_after_forward
        # The plan's layers of this stage over "tp", then FSDP over ("replicate", "shard"): this stage's
        # shards, every replica.
        trainer.shard(mesh, reshard)
        self.pipe_group = mesh["stage"].get_group()  # group rank = stage (torch's PipelineStage peers)
        self.saver = AsyncSaver(self.config.collective_timeout_s)
        self.make_schedule(trainer)  # type: ignore[arg-type]
        # No flat parameter buffer to leave out: the parameters FSDP gathers and autograd saves count too.
        self.meter = ActivationMeter(-1)
        # FSDP's gathers and reduce-scatter as ShardedBSP counts them for one batch (a lower bound: with
        # --reshard-after-forward each micro-batch's forward gathers the stage again).
        self.traffic = fsdp_bytes_per_step(trainer.tp_numel * 4, R, D, reshard)
        # The whole model's checkpoint keys, in stage order (= the model's order), for rank 0's reference.
        parts: list[Any] = [None] * S
        dist.all_gather_object(parts, trainer.checkpoint_keys(), group=self.pipe_group)
        self.whole_keys = {key: [k for part in parts for k in part[key]] for key in parts[0]}

    # ------------------------------------------------------------------ the step
    def _zero_grads(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        assert trainer.optimizer is not None
        trainer.optimizer.zero_grad(set_to_none=True)

    def _grads_done(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        """FSDP holds the gradient shards itself (the schedule's last backward reduce-scattered them)."""

    def _grad_bytes(self, trainer: ShardedTrainer) -> int:  # type: ignore[override]
        return trainer.grad_bytes()

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        import torch.distributed as dist

        from distrain.trainers.optim_state import state_bytes

        t0 = time.perf_counter()
        # --clip-grad-norm: the whole model's norm, each stage's shards counted once over every worker
        # (the schedule zeroed the trainer's own limit: PipelineBSP.make_schedule).
        trainer.clip_gradient_(None, limit=self.config.clip_grad_norm)
        # Every worker holds a different piece of the gradient: the sum over all of them decides for all,
        # so every stage and shard skips (or stops) together.
        total = trainer.local_grad_sum()
        dist.all_reduce(total)
        seconds = time.perf_counter() - t0
        applied = self.finite(bool(total.isfinite()), "all-reduced gradient")
        if applied:
            trainer.apply_update(lr)
        extra = dict(self.stats) | {"shard": self.shard, "mem_optim_bytes": state_bytes(trainer.optimizer)}
        sent, got = self.bytes_p2p
        return CommStats(
            seconds=seconds,
            bytes_sent=sent + self.traffic,
            bytes_received=got + self.traffic,
            nonfinite=None if applied else True,
            extra=extra,
        )

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, trainer: ShardedTrainer, batches: Iterable[Any]) -> dict[str, tuple[float, float]]:  # type: ignore[override]
        """Each of the replica's D x T pipelines runs the replica's share (the stage's forward gathers its
        parameters from all D shards, its split layers talk over the T workers); shard 0's TP rank 0's
        last stage scores it."""
        totals = super().evaluate(trainer, batches)  # type: ignore[arg-type]
        return totals if self.shard == 0 and self.tp_rank == 0 else {}

    # ------------------------------------------------------------------ state
    def at_epoch_end(self, trainer: ShardedTrainer) -> CommStats | None:  # type: ignore[override]
        """Nothing gathered: checkpoints are the workers' own shards (`checkpoint_shards`)."""
        return None

    # Each worker writes its stage's shards as ShardedBSP's workers do; rank 0's reference names the
    # whole model's keys (`checkpoint_keys`).
    checkpoint_shards = ShardedBSP.checkpoint_shards
    checkpoint_entries = ShardedBSP.checkpoint_entries
    export_state = ShardedBSP.export_state

    def checkpoint_keys(self, trainer: ShardedTrainer) -> dict[str, list[str]]:
        return self.whole_keys

    def teardown(self) -> None:
        """The save in flight is written before the group it runs over goes."""
        saver = getattr(self, "saver", None)
        if saver is not None:
            saver.close()
        super().teardown()
