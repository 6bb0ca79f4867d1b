"""BSP across cut replicas under `--workers MIN..MAX` (`--fsdp D`, over the collective transport; issue 28):
whole replicas of D workers join and leave a live run, HSDP across whichever replicas are there.

Slots are replicas of D workers, joining and leaving whole; the re-form (a fresh trainer cut over the new
(R', D) mesh, worker d's pieces from a live replica's worker d, nothing from disk), the placeholder's pass
and evaluations and checkpoints from one replica are strategies/elastic_cut.py's (`ElasticCut`), shared
with elastic local SGD and DiLoCo across cut replicas.

A round: FSDP reduces each gradient to the mean over the R' x D workers inside backward (a worker
sitting a round out with a placeholder unit runs its backward on a batch at weight 0, since FSDP's
collectives need every worker); one all-reduce of [w, w x lr, the gradient pieces' sum] then makes it
the mean over the units really there (x R'D / Σw), the rate elastic BSP's (`lr_factor` for Σw of
MAX x D slices), and finiteness one run-wide answer. A failed collective (a peer gone) raises
`GroupBroken` before anything is applied.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from distrain.strategies.base import CommStats
from distrain.strategies.elastic_cut import ElasticCut
from distrain.strategies.elastic_group import GroupBroken, lr_factor
from distrain.strategies.sharded_bsp import ShardedBSP

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.trainers.sharded_trainer import ShardedTrainer


class ElasticShardedBSP(ElasticCut, ShardedBSP):
    """HSDP across the live replicas (the module docstring); the group, the cut, the placeholder's pass and
    the replica's state are `ElasticCut`'s, shared with elastic local SGD and DiLoCo across cut replicas."""

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        return config.segment_steps

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
