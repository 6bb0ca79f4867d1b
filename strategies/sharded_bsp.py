"""BSP across cut replicas (`--fsdp D`, `--tensor-parallel T`; `BSP.implementation` picks it): HSDP with
torch's FSDP2, and tensor parallelism inside.

R x D x T worker actors; actor rank = (replica x D + shard) x T + tp, and data-parallel rank
(replica, shard) takes slice replica x D + shard of each step's R x D x B samples, its T workers
sharing it; under a hybrid plan (the cnn's: trainers/builtin_names.py `tp_sample_ranks`) every worker
takes its own, slice = rank of R x D x T x B. The run's device mesh is (R, D, T) = ("replicate",
"shard", "tp"): the task's plan splits its layers over "tp" first (trainers/tensor_parallel.py), then
`fully_shard` over ("replicate", "shard") (trainers/sharded_trainer.py)
all-gathers each layer's parameters inside the replica before the layer runs, reduce-scatters its
gradient inside the replica, and all-reduces the gradient shards across the R replicas. Every worker
then holds the mean gradient over all R x D batches for its own shard and steps its own optimizer on
it: the update BSP makes on the global batch, with 1/D of the state in each worker.

FSDP's collectives run inside forward and backward, on the run's process group but not through the
channel's calls, so a row's bytes are the model's (per rank and step: all-gather in forward and, with
--reshard-after-forward, again in backward, (D-1)/D x the parameter bytes each; reduce-scatter (D-1)/D;
across replicas 2(R-1)/R x the shard's bytes) and its comm seconds are the run-wide finiteness check's.

Under --precision bf16|fp16 FSDP gathers the parameters in that dtype and reduces the gradients in
float32 (trainers/sharded_trainer.py `mixed_precision_policy`); fp16's overflow check is one all-reduce of
the gradient pieces' sum over every worker of the run, so all skip the same steps (`step`).

Under --compress no codec could act inside HSDP's all-reduce, so FSDP spans each replica's "shard"
dimension only (`channel_grads`) and, after backward, every worker averages its part of the replica's mean
gradient with the R - 1 workers holding that part in the other replicas, through the channel's "grads"
stream over the mesh's "replicate" group (`average_gradient`: the codec, this worker's error feedback,
PowerSGD on each part as a matrix). The row then counts FSDP's traffic inside the replica plus what the
codec sent (`bytes_uncompressed`: the float32 all-reduce of the part instead).

Unequal replica shares (--worker-weights, one weight per replica; --balance speed; docs/heterogeneous.md)
take the same path: replica r takes b_r samples of the step's B, a multiple of its D data-parallel ranks
(config/shares_section.py `share_unit`), each rank b_r / D of the replica's block (`share_cut`), so FSDP's
mean inside the replica is the mean over its b_r samples; every worker then multiplies its part by
b_r x R / B before the all-reduce over "replicate" (`weigh_share`), and the mean over the R replicas is
the whole batch's mean gradient: the update of one process at B. HSDP's own all-reduce cannot take a
weight per replica in its reduction, and, running inside backward, it would make every replica's compute
time the slowest one's, hiding from --balance speed which replica is slow: after backward, a replica's
compute time is its own (its slowest worker's, whom FSDP's collectives inside it wait for) and the
average across replicas is counted as communication. Rows record the replica's share
(`replica_samples`), which the balancer reads per worker (orchestrator/pipeline_balance.py).

Checkpoints: at each step a checkpoint is due after, every worker begins writing its own shards through
torch.distributed.checkpoint in a background thread (`checkpoint_shards`, trainers/sharded_checkpoint.py)
and the row records the seconds training was blocked (`ckpt_block_s`); rank 0's `export_state` hands the
driver a reference to that directory, which the driver writes into the checkpoint file once the
directory is complete. No worker ever holds the whole model or optimizer state.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrain.compression.spec import codec_of
from distrain.strategies.base import CommStats, ShardsSaved, Strategy, StrategyContext
from distrain.trainers.builtin_names import tp_sample_ranks

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.strategies.channel import Traffic
    from distrain.trainers.sharded_trainer import ShardedTrainer

SHARDED_COLUMNS = {
    "replica": "int32",
    "shard": "int32",  # the worker's FSDP rank within its replica (0..D-1)
    "tp": "int32",  # its tensor-parallel rank (0..T-1)
    # The replica's samples this step, on each of its workers' rows, under unequal shares (null otherwise):
    # what --balance speed reads each worker's time against (`samples` is this worker's part, or 0).
    "replica_samples": "int32",
    "mem_param_bytes": "int64",  # parameter bytes this worker holds: its shards
    "mem_grad_bytes": "int64",
    "mem_optim_bytes": "int64",
    "ckpt_block_s": "float64",  # seconds a checkpoint's save blocked this worker (steps a checkpoint follows)
}


def fsdp_bytes_per_step(
    param_bytes: int, replicas: int, shards: int, reshard_after_forward: bool, gather_bytes: int | None = None
) -> int:
    """Bytes one worker sends (and receives) per step under HSDP: all-gathers and a reduce-scatter of
    (D-1)/D x the parameter bytes each (two all-gathers when parameters are freed after the forward),
    then a ring all-reduce of its 1/D shard across the R replicas. `gather_bytes`: the parameters in the
    dtype they are gathered in (--precision bf16/fp16: half of `param_bytes`; the gradient is reduced
    float32)."""
    gathers = 2 if reshard_after_forward else 1
    gathered = param_bytes if gather_bytes is None else gather_bytes
    inside = (gathers * gathered + param_bytes) * (shards - 1) // shards
    across = 2 * (replicas - 1) * (param_bytes // shards) // replicas
    return inside + across


class ShardedBSP(Strategy):
    name = "bsp"
    metric_columns = SHARDED_COLUMNS

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.shards, self.tp, _ = config.replica_grid
        self.replicas = ctx.world_size // (self.shards * self.tp)
        # rank = (replica x D + shard) x T + tp: a data-parallel rank's T workers are neighbours.
        self.dp_rank, self.tp_rank = divmod(ctx.rank, self.tp)
        self.replica, self.shard = divmod(self.dp_rank, self.shards)
        self.own_samples = tp_sample_ranks(config.model, config.task, self.tp) > 1  # a hybrid plan
        self.saved: dict[str, Any] | None = None  # the last checkpoint begun: its directory and step
        # --compress, or unequal replica shares: the gradient's average across the replicas goes through the
        # channel (its codec; the replica's weight), so FSDP stays inside each replica and `step` averages
        # each worker's part over the "replicate" group.
        shares = config.unequal_shares and self.replicas > 1
        self.channel_grads = self.codes_gradients and (codec_of(config) is not None or shares)
        if self.channel_grads:
            self.fsdp_across_replicas = False
        self.replica_samples: int | None = None  # the replica's share of the step (`weigh_share`)
        # Unequal shares: a replica's workers leave each step together (`step`), so that compute times are
        # the replica's own (what --balance speed and straggler detection read).
        self.replica_barrier = self.channel_grads and shares

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        """`checkpoint_blocking_s`: per save (the most any worker was blocked at that step), the median and
        the most, over the run's saves (none: no entry)."""
        per_save: dict[int, float] = {}
        for step, blocked in zip(steps.get("step", []), steps.get("ckpt_block_s", []), strict=False):
            if blocked is not None and blocked == blocked:  # NaN: a row without a save
                per_save[step] = max(per_save.get(step, 0.0), float(blocked))
        if not per_save:
            return {}
        import statistics

        values = list(per_save.values())
        figure = {"saves": len(values), "median": statistics.median(values), "max": max(values)}
        return {"checkpoint_blocking_s": figure}

    @property
    def slices_per_step(self) -> int:
        """R x D data-parallel ranks, a rank's T tensor-parallel workers sharing its slice; under a hybrid
        plan each of the R x D x T workers has its own."""
        return self.replicas * self.shards * (self.tp if self.own_samples else 1)

    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        # The work plan gives actor r slice r: a hybrid's worker keeps it, others take their data-parallel rank's.
        for epoch, step, _ in units:
            yield epoch, step, self.ctx.rank if self.own_samples else self.dp_rank

    @property
    def counts_samples(self) -> bool:
        """A data-parallel rank's T workers share its batch: the first counts it (each its own: all)."""
        return self.own_samples or self.tp_rank == 0

    @property
    def share_cut(self) -> int:
        """A replica's share is cut equally among its data-parallel ranks (its D, or D x T under a hybrid
        plan): slice s of a step takes part s % cut of replica s // cut's block."""
        return self.slices_per_step // self.replicas

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """Unequal replica shares: this worker reads `samples` = b_r / D of the step's B, so its replica
        took b_r (the row's `replica_samples`), and its part of the replica's mean gradient is weighted
        by b_r x R / B before the average across the replicas (`average_gradient`): the default weight
        b_i x N / B over the R x D slices, the same number."""
        self.replica_samples = samples * self.share_cut
        super().weigh_share(samples, step_samples)

    # FSDP spans every replica's data-parallel workers (HSDP); a subclass whose replicas step alone
    # between synchronisations (ShardedDiLoCo) keeps it inside the replica, and so does BSP under
    # --compress or unequal shares (`channel_grads`: the channel averages the parts across the replicas).
    fsdp_across_replicas = True
    # Whether, under --compress or unequal shares, `step` averages the gradient across the replicas through
    # the channel (BSP); False for a subclass whose replicas step alone (local SGD, DiLoCo: their rounds go
    # through it), push to the shards (the PS strategies) or re-form (elastic: --compress is refused there).
    codes_gradients = True
    # The workers whose gradient sums decide together whether a step is skipped: all of them (None: the
    # run's group), one HSDP step; a subclass whose replicas step alone may set a replica's own group.
    step_group: Any = None

    def setup(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        self.join_mesh(trainer)

    def join_mesh(self, trainer: ShardedTrainer) -> Any:
        """Join the run's group, make the (R, D, T) mesh, cut the trainer's model over it, and count what
        FSDP moves per step: a tensor-parallel worker's own part of the parameters (tensor parallelism's
        activation all-reduces are not counted here)."""
        import torch.distributed as dist

        if not self.channel.joined:  # (an elastic replica on the PS joined its own group: sharded_ps.py)
            self.channel.join()
        replicas = self.channel.world_size // (self.shards * self.tp)  # the group's: the run's, or one replica
        mesh = self.channel.device_mesh((replicas, self.shards, self.tp), ("replicate", "shard", "tp"))
        # The workers holding the gradient one update applies (--clip-grad-norm's norm is theirs): every
        # worker of the run (None) when FSDP spans the replicas, else the replica's own D x T, whose steps
        # are its own (every worker creates every replica's group).
        self.update_group = None
        if not self.fsdp_across_replicas and replicas > 1:
            size = self.shards * self.tp
            self.update_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(r * size, (r + 1) * size)) for r in range(replicas)]
            )
        reshard = self.config.reshard_after_forward
        trainer.shard(mesh, reshard, across_replicas=self.fsdp_across_replicas, own_samples=self.own_samples)
        if self.channel_grads:  # each worker's part of the gradient, averaged with the R workers holding it
            self.channel.open("grads", shapes=local_shapes(trainer.params), group=mesh["replicate"].get_group())
        from distrain.trainers.sharded_checkpoint import AsyncSaver

        self.saver = AsyncSaver(self.config.collective_timeout_s)
        fsdp_replicas = self.replicas if self.fsdp_across_replicas else 1
        gathered = trainer.tp_numel * (2 if self.config.precision != "fp32" else 4)  # FSDP's param_dtype
        self.traffic = fsdp_bytes_per_step(trainer.tp_numel * 4, fsdp_replicas, self.shards, reshard, gathered)
        if trainer.hybrid is not None:  # its whole parameters' gradients, ring all-reduced over the T workers
            self.traffic += 2 * (self.tp - 1) * trainer.hybrid.numel(trainer.model) * 4 // self.tp
        return mesh

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        import torch.distributed as dist

        trainer.unscale_grads_()  # --precision fp16: the reduced gradient, divided by the loss scale
        # --compress or unequal shares: FSDP averaged the gradient inside the replica; across the replicas,
        # through the channel (its codec; each replica's weight).
        coded = self.average_gradient(trainer) if self.channel_grads else None
        t0 = time.perf_counter()
        if self.replica_barrier and self.config.on_nonfinite != "skip":  # (skip's all-reduce below is one)
            # Each worker's average pairs it with one worker of each other replica: without this, a worker
            # whose pair was fast would begin its next forward while a mate still waits for a slow replica,
            # and that wait would count as its compute (FSDP's all-gather waits for the mate), making every
            # replica look as slow as the slowest. Waiting here counts as communication instead.
            dist.barrier(group=self.update_group)
        # --clip-grad-norm: the norm of the update's whole gradient (reduced over the replicas under HSDP or
        # the codec, the replica's own under local steps), each element counted once; every worker of
        # `update_group` scales its pieces alike (all replicas hold the same averaged gradient).
        trainer.clip_gradient_(self.update_group)
        total = trainer.local_grad_sum()
        if trainer.scaler is not None:
            # fp16: an overflow leaves inf in some workers' pieces only. The sum over every worker of the
            # run decides for all, so all skip the same steps and halve their scales alike: a replica's
            # shards stay one model, and (even where replicas step alone between rounds, local SGD and
            # DiLoCo) every replica keeps the one scale a checkpoint records and each loss is scaled by.
            dist.all_reduce(total)
        elif self.config.on_nonfinite == "skip":
            # Every worker holds a different shard: the sum over all of them decides for all (a NaN or inf
            # anywhere makes it so), so the R x D workers (those of `step_group`) skip together.
            dist.all_reduce(total, group=self.step_group)
        # --on-nonfinite stop (the default) needs no agreement, so no all-reduce (a barrier every step):
        # the first worker whose shard is not finite stops the run, which ends diverged with nothing
        # saved after its last good checkpoint, whatever the others applied meanwhile.
        seconds = time.perf_counter() - t0
        applied = self.gradient_decision(trainer.scaler, bool(total.isfinite()), "reduced gradient")
        if applied:
            trainer.apply_update(lr)
        extra = self.layout_columns(trainer)
        stats = CommStats(
            seconds=seconds,
            bytes_sent=self.traffic,
            bytes_received=self.traffic,
            nonfinite=None if applied else True,
            extra=extra,
        )
        return stats if coded is None else stats.add(coded)

    def average_gradient(self, trainer: ShardedTrainer) -> Traffic:
        """This worker's part of the gradient (FSDP's mean over its replica's D workers) averaged with the
        parts the other replicas' workers at its place in the grid hold, through the channel's codec with
        this worker's error feedback: the mean over all R x D batches, as HSDP's all-reduce makes it.
        Under unequal shares each part is weighted by its replica's b_r x R / B first (`weigh_share`)."""
        import torch

        from distrain.trainers.sharded_trainer import local_part

        parts = [None if p.grad is None else local_part(p.grad) for p in trainer.params]
        flat = torch.cat(
            [
                (torch.zeros_like(local_part(p.detach())) if g is None else g.detach()).reshape(-1)
                for g, p in zip(parts, trainer.params, strict=True)
            ]
        )
        if self.channel.gradient_weight != 1.0:  # its replica's share of the step
            flat.mul_(self.channel.gradient_weight)
        traffic = self.channel.all_reduce("grads", flat)
        offset = 0
        with torch.no_grad():
            for g, p in zip(parts, trainer.params, strict=True):
                n = local_part(p).numel()
                if g is not None:
                    g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
        return traffic

    # ------------------------------------------------------------------ evaluation
    def eval_share(self, shard: int, num_shards: int) -> tuple[int, int]:
        """A replica's D workers score the same share of the test set (each forward gathers the layers
        from all of them); replica r takes share r of R. A hybrid's T workers too: each feeds the same
        batch, so the gathered batch is T copies of it and each worker's copy of the logits is the
        whole batch's (the classifier computes T times over; evaluation stays the task's own)."""
        return self.replica, self.replicas

    def evaluate(self, trainer: ShardedTrainer, batches: Iterable[Any]) -> dict[str, tuple[float, float]]:  # type: ignore[override]
        """Every worker of the replica runs the forward passes; its first worker's scores count."""
        totals = trainer.evaluate(batches)
        return totals if self.shard == 0 and self.tp_rank == 0 else {}

    def layout_columns(self, trainer: ShardedTrainer) -> dict[str, int | None]:
        """This worker's place in the grid and the bytes it holds: its step row's layout columns."""
        from distrain.trainers.optim_state import state_bytes

        return {
            "replica": self.replica,
            "shard": self.shard,
            "tp": self.tp_rank,
            "replica_samples": self.replica_samples,
            "mem_param_bytes": trainer.nbytes,
            "mem_grad_bytes": trainer.grad_bytes(),
            "mem_optim_bytes": state_bytes(trainer.optimizer),
        }

    # ------------------------------------------------------------------ state
    def checkpoint_shards(self, trainer: ShardedTrainer, step: int, directory: Path) -> ShardsSaved:  # type: ignore[override]
        """Begin writing this worker's shards of the state after `step` steps (every worker at once).
        Whether its parameters are finite goes back with its rows (no barrier here): the driver writes
        the checkpoint only if every worker's were."""

        from distrain.trainers.sharded_checkpoint import forget_save, state_dir_name
        from distrain.trainers.sharded_trainer import local_sum

        t0 = time.perf_counter()
        name = state_dir_name(step)
        if self.ctx.rank == 0:  # an earlier attempt's save of this step (a run recovered after a failure)
            forget_save(directory / name)  # is not this one: its index goes (DCP's planning is a barrier)
        finite = bool(local_sum(trainer.params).isfinite())
        # The reference is made before the save begins (once its thread runs, it plans under the GIL) and
        # kept once the save has begun.
        saved = {"dir": name, "step": step, "finite": finite} | self.checkpoint_keys(trainer)
        saved |= trainer.scheduler_state()  # a task's own scheduler: its position, in the reference
        entries = trainer.checkpoint_entries() | self.checkpoint_entries(trainer)
        self.saver.save(entries, directory / name)
        self.saved = saved
        return ShardsSaved(time.perf_counter() - t0, finite)  # the wait for the last save, the staging

    def checkpoint_keys(self, trainer: ShardedTrainer) -> dict[str, list[str]]:
        """The whole model's state dict keys and parameter names, in order (a pipeline stage's worker
        holds only its stage's: ShardedPipelineBSP gathers its replica's)."""
        return trainer.checkpoint_keys()

    def teardown(self) -> None:
        """The save in flight is written before the group it runs over goes (a warm worker's next run
        must not meet this run's save thread in its collectives)."""
        saver = getattr(self, "saver", None)
        if saver is not None:
            saver.close()
        super().teardown()

    def checkpoint_entries(self, trainer: ShardedTrainer) -> dict[str, Any]:
        """The strategy's own tensors for the checkpoint (none under BSP)."""
        return {}

    def export_state(self, trainer: ShardedTrainer) -> dict[str, Any]:  # type: ignore[override]
        """A reference to the last checkpoint this worker began (the driver waits for it to be complete;
        step None: none yet, and the driver has one begun: Attempt.finish)."""
        return {"sharded": dict(self.saved) if self.saved is not None else {"step": None}}


def local_shapes(params: list[Any]) -> list[Any]:
    """The shapes of this worker's parts of `params` (a DTensor's local shard: FSDP's rows, a
    tensor-parallel split), in order: a stream's shapes, so PowerSGD compresses each part as a matrix."""
    from distrain.trainers.sharded_trainer import local_part

    return [local_part(p.detach()).shape for p in params]
