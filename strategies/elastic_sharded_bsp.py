"""BSP across cut replicas under `--workers MIN..MAX` (`--fsdp D`, `--tensor-parallel T`, over the
collective transport; issue 28): whole replicas of D x T workers join and leave a live run, HSDP across
whichever replicas are there, tensor parallelism inside each.

Slots are replicas: replica r's D x T workers are actor ranks r x DT .. r x DT + DT - 1, rank =
(replica x D + d) x T + t (orchestrator/membership.py places one group of D x T bundles per replica),
and a worker lost takes its whole replica out (orchestrator/controller/collective_scaling.py). The
books are elastic BSP's (orchestrator/rounds.py) over MAX x D slices a step: a data-parallel rank's T
workers take one unit together each round (`RoundPlan.share` = T: the deal hands a rank's T workers the
same units), so a round of R' replicas is R' x D units; under a hybrid plan (the cnn's: each
tensor-parallel worker on its own samples) a step is MAX x D x T slices and every worker takes its own.

The re-form, the placeholder's pass, and evaluations and checkpoints from one replica are
strategies/elastic_cut.py's (`ElasticCut`), shared with elastic local SGD and DiLoCo across cut
replicas: every member joins the new group, makes the (R', D, T) mesh ("replicate", "shard", "tp") and a
fresh trainer cut over it (FSDP2 cannot be moved to another mesh: the task's plan over "tp", then FSDP
over the R' x D data-parallel workers), puts its own pieces back (trainers/replica_shards.py
`load_local`: D and T do not change, so worker (d, t)'s pieces keep their layout) and takes those of the
source replica's worker (d, t) by a broadcast over the mesh's "replicate" group: a joiner's worker (d, t)
gets live worker (d, t)'s model and optimizer pieces, a plain copy of local tensors, and fp16's loss
scale; a survivor that got a round further is brought back to the source's round. Nothing is read from
disk.

A round: FSDP reduces each gradient to the mean over the R' x D data-parallel workers inside backward (a
worker sitting a round out with a placeholder unit runs its backward on a batch at weight 0, since
FSDP's collectives need every worker; a rank's T workers sit out together, each of a hybrid's alone);
one all-reduce of [w, w x lr, the gradient pieces' sum] then makes it the mean over the units really
there (x R'DT / Σw: Σw counts T workers a unit, or one under a hybrid, whose HybridGradients means over
the T workers too), the rate elastic BSP's (`lr_factor` for the units of MAX x D slices), and
finiteness one run-wide answer: under --precision fp16 an overflow is skipped by every member and every
member halves its scale alike (`gradient_decision`), as the fixed-size path does. A failed collective
(a peer gone) raises `GroupBroken` before anything is applied.

Checkpoints and evaluations come from one replica: its D x T workers evaluate the whole test set
together (worker (0, 0) returns the scores) and gather the whole state (`whole_state`), so the driver
writes the layout-free checkpoint every reader takes; no worker writes checkpoint shards.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from distrain.strategies.base import CommStats
from distrain.strategies.elastic_cut import COLLECTIVE_ERRORS, ElasticCut
from distrain.strategies.elastic_group import GroupBroken, lr_factor
from distrain.strategies.sharded_bsp import ShardedBSP

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.strategies.base import StrategyContext
    from distrain.trainers.sharded_trainer import ShardedTrainer


class ElasticShardedBSP(ElasticCut, ShardedBSP):
    """HSDP across the live replicas (the module docstring); the group, the cut, the placeholder's pass and
    the replica's state are `ElasticCut`'s, shared with elastic local SGD and DiLoCo across cut replicas.
    Under --balance speed FSDP spans each replica's own D x T workers and the replicas' means are averaged
    after backward, each weighted by its share (`balanced_step`)."""

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        if self.balanced:  # each replica's mean weighted by its share: FSDP inside the replica only
            self.fsdp_across_replicas = False

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        return config.segment_steps

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        import torch
        import torch.distributed as dist

        from distrain.trainers.sharded_trainer import local_part

        assert self.channel.joined, "reform() must run before step()"
        if self.balanced:
            return self.balanced_step(trainer, lr)
        trainer.unscale_grads_()  # --precision fp16: the reduced gradient, divided by the loss scale
        t0 = time.perf_counter()
        size = self.channel.world_size
        total = float(trainer.local_grad_sum())
        device = "cuda" if self.ctx.device.startswith("cuda") else "cpu"
        buffer = torch.tensor([self.weight, self.weight * lr, total], dtype=torch.float64, device=device)
        try:
            dist.all_reduce(buffer)
        except (RuntimeError, OSError) as e:
            raise GroupBroken(str(e)) from e
        # Σw counts workers with a unit; a unit is a data-parallel rank's, taken by its T workers together
        # (each of them under a hybrid plan).
        weights = int(round(float(buffer[0])))
        units = weights // self.workers_per_unit
        members = {"members": size}
        if units == 0:  # nobody had a unit (never dealt so): nothing to apply
            return CommStats(seconds=time.perf_counter() - t0, extra=self.layout_columns(trainer) | members)
        if weights != size:
            # FSDP's mean is over every data-parallel worker (a hybrid's HybridGradients over the T workers'
            # too); the placeholders' zeros are no samples. Both kinds of mean are over size / per-unit
            # parts, of which units are real: x size / Σw.
            for p in trainer.params:
                if p.grad is not None:
                    local_part(p.grad).mul_(size / weights)
        c = self.config
        factor = lr_factor(units, self.slices_per_step, c.batch_size, c.base_batch_size, c.lr_scaling)
        rate = float(buffer[1]) / weights * factor
        try:
            trainer.clip_gradient_(None)
        except (RuntimeError, OSError) as e:
            raise GroupBroken(str(e)) from e
        seconds = time.perf_counter() - t0
        # One run-wide answer (the all-reduced sum): under fp16 an overflow is skipped by every member alike
        # and every member's scale moves alike (a re-form carries it: TrainWorker._reform_cut).
        applied = self.gradient_decision(trainer.scaler, bool(torch.isfinite(buffer[2])), "reduced gradient")
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

    def balanced_step(self, trainer: ShardedTrainer, lr: float) -> CommStats:
        """--balance speed (a round is one whole step of B cut among the member replicas by their shares,
        orchestrator/rounds.py `StepRoundPlan`): FSDP made each worker's part the mean over its replica's
        b_r samples (each data-parallel rank b_r / D of them); every worker weights its part by b_r / B
        (`share_weight`) and sums it with the workers holding that part in the other replicas (the mesh's
        "replicate" group, through the channel and its emulated link), so every replica holds Σ b_r g_r / B,
        the whole batch's mean gradient, as at a fixed size (strategies/sharded_bsp.py `channel_grads`).
        The rate is unscaled (every round is the whole global batch). Running after backward, the average
        leaves each replica's compute time its own (what the balancer reads); one all-reduce over the run
        then decides finiteness for every member (fp16: every scale moves alike) and makes the replicas
        leave the step together, its wait counted as communication."""
        import torch
        import torch.distributed as dist

        from distrain.trainers.sharded_trainer import local_part

        trainer.unscale_grads_()  # --precision fp16: the replica's reduced gradient, divided by the loss scale
        t0 = time.perf_counter()
        size = self.channel.world_size
        parts = [None if p.grad is None else local_part(p.grad) for p in trainer.params]
        flat = torch.cat(
            [
                (torch.zeros_like(local_part(p.detach())) if g is None else g.detach()).reshape(-1)
                for g, p in zip(parts, trainer.params, strict=True)
            ]
        )
        flat.mul_(self.weight * self.share_weight)
        try:
            traffic = self.channel.all_reduce("grads", flat, op="sum", subgroup=self.across)
        except COLLECTIVE_ERRORS as e:
            raise GroupBroken(str(e)) from e
        offset = 0
        with torch.no_grad():
            for g, p in zip(parts, trainer.params, strict=True):
                n = local_part(p).numel()
                if g is not None:
                    g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
        device = "cuda" if self.ctx.device.startswith("cuda") else "cpu"
        buffer = torch.tensor([self.weight, float(trainer.local_grad_sum())], dtype=torch.float64, device=device)
        try:
            dist.all_reduce(buffer)
            trainer.clip_gradient_(self.update_group)  # the replica's D x T workers: each element once
        except COLLECTIVE_ERRORS as e:
            raise GroupBroken(str(e)) from e
        members = {"members": size}
        stats = CommStats(seconds=time.perf_counter() - t0, extra=self.layout_columns(trainer) | members)
        if int(round(float(buffer[0]))) == 0:  # nobody had a unit (never dealt so): nothing to apply
            return stats
        applied = self.gradient_decision(trainer.scaler, bool(torch.isfinite(buffer[1])), "reduced gradient")
        if applied:
            trainer.apply_update(lr)
        stats.bytes_sent = stats.bytes_received = self.traffic
        stats.nonfinite = None if applied else True
        stats.lr = lr
        return stats.add(traffic)
