"""Local SGD and AdaComm across cut replicas (`--strategy local-sgd --fsdp D` and/or `--tensor-parallel T`;
`LocalSGD.implementation` picks it): the local steps are each replica's own FSDP (and TP) steps, the
averaging round works part by part.

As under DiLoCo across cut replicas (strategies/sharded_diloco.py), FSDP spans the replica's own "shard"
dimension only, so nothing crosses replicas between rounds: replica i's D x T workers take τ local steps
on their R x D x B share of the samples, deciding together (a replica's own group) whether a step is
skipped. Every τ steps each worker averages its own part of the parameters (as their change since the last
round, like plain local SGD) and of the optimizer's state vectors over the R workers that hold the same
part in the other replicas (the mesh's "replicate" group): a round moves 1/(D x T) of what a plain
replica's moves, and no worker holds the whole model. AdaComm's statistics ([loss sum, loss count,
interval seconds], and whether the averaged part is finite) are summed over every worker of the run in a
second, tiny all-reduce, so every worker of every replica skips a round alike and chooses the same τ; the
worker-averaged loss is the mean of the R x D batch losses, which is what R plain replicas at D x B
average. Periods are cut at epoch ends and step checkpoints as plain local SGD cuts them, so a
checkpoint's shards (ShardedBSP's `checkpoint_shards`) hold the averaged state, equal on every replica.
Under --compress the part of θ's change goes through the channel's codec over the "replicate" group (the
"params" stream, error feedback per worker, PowerSGD on each part as a matrix) and the optimizer's state
follows float32, as plain local SGD sends them. Unequal replica shares (--worker-weights, --balance speed):
each replica takes its local steps at its own b_r (cut equally among its D ranks, as under BSP), and a
round weighs each part of θ's change and of the optimizer state by the samples its replica trained on in
the period (`ShareTally`, as plain local SGD does), so the mean over the R replicas is Σ m_r x_r / Σ m_r
and τ = 1 is BSP at the global batch, momentum included. The emulated link (--comm-delay-ms, --comm-bandwidth)
is the one between replicas: a round's "params" all-reduce over the "replicate" group pays it (the channel's,
one link per worker), the local steps' FSDP traffic inside the replica does not. --workers MIN..MAX is not
built across cut replicas (config/layout_section.py refuses it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats, StrategyContext, all_finite
from distrain.strategies.channel import Traffic
from distrain.strategies.local_periods import LocalPeriods
from distrain.strategies.sharded_bsp import ShardedBSP, local_shapes
from distrain.trainers.shares import ShareTally

if TYPE_CHECKING:
    import torch

    from distrain.config import RunConfig
    from distrain.trainers.sharded_trainer import ShardedTrainer


class ShardedLocalSGD(LocalPeriods, ShardedBSP):
    name = "local-sgd"
    fsdp_across_replicas = False  # the local steps are each replica's own
    codes_gradients = False

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)  # self.options: local SGD's (this class's name)
        self.init_periods(config, self.options, ctx.total_steps)
        self.anchor: torch.Tensor | None = None  # this worker's part of θ after the last round, flat
        self.tally = ShareTally()  # unequal shares: the samples this worker took since the last round

    def setup(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        mesh = self.join_mesh(trainer)
        self.across = mesh["replicate"].get_group()  # the workers holding this worker's part elsewhere
        self.step_group = self.update_group  # a replica's own D x T workers decide its local steps
        # θ's change under --compress (a codec's shapes: this worker's parts), then the optimizer state float32.
        self.channel.open("params", shapes=local_shapes(trainer.params), group=self.across)
        # Replicas start equal (the same seed, or the same loaded state), as plain local SGD's broadcast makes them.
        self.anchor = _flat(trainer.params).clone()
        self.interval_start = time.perf_counter()

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        local = ShardedBSP.step(self, trainer, lr)  # the local step: the replica's own FSDP step
        stats = self.book_step(trainer, lr, ok=not local.nonfinite)
        # FSDP's float32 traffic inside the replica, counted as sent in `bytes_uncompressed` too (a round's row).
        stats.add(Traffic(local.seconds, local.bytes_sent, local.bytes_received))
        stats.extra.update(local.extra)
        return stats

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """Unequal replica shares: the round weighs this worker's parts by the samples it took in the
        period, b_r / D a step (`ShareTally`: x R x D / the period's samples, i.e. its replica's mean
        b_r x R / B), which the mean over the R replicas turns into the samples-weighted average."""
        self.replica_samples = samples * self.share_cut
        self.tally.add(samples, step_samples)

    def at_epoch_end(self, trainer: ShardedTrainer) -> CommStats | None:  # type: ignore[override]
        """Close the period: a round if local steps were taken since the last."""
        stats = self.average(trainer) if self.pending > 0 else CommStats()
        stats.averaging_round = self.rounds
        return stats

    def average(self, trainer: ShardedTrainer) -> CommStats:  # type: ignore[override]
        """One round: this worker's part of θ's change and of the optimizer's state vectors, averaged over
        the replicas; the statistics and the finiteness of every part summed over the run."""
        import torch
        import torch.distributed as dist

        from distrain.strategies.collective import ring_allreduce_bytes
        from distrain.trainers.sharded_trainer import local_part

        assert self.anchor is not None, "setup() must run before step()"
        t0 = time.perf_counter()
        n = self.anchor.numel()
        vectors = state_vectors(trainer)
        buffer = torch.cat([_flat(trainer.params) - self.anchor, *(_flat(parts) for parts in vectors.values())])
        weight = self.tally.take(self.slices_per_step)  # 1 with equal shares
        if weight != 1.0:  # θ's change and the optimizer state (the statistics travel apart)
            buffer.mul_(weight)
        # As plain local SGD: θ's change through the codec (--compress), the optimizer state float32 after it.
        traffic = self.channel.all_reduce("params", buffer, exact_tail=buffer.numel() - n)
        broken = 0.0 if all_finite(buffer) else 1.0
        totals = torch.tensor([*self.period_statistics(), broken], dtype=torch.float64, device=buffer.device)
        dist.all_reduce(totals)  # every worker of every replica: one decision, one τ
        loss_sum, loss_count, elapsed_sum, broken = totals.tolist()
        finite = self.finite(broken == 0, "averaged parameters")
        if finite:  # else the round is discarded: back to the last average, optimizer state as it is
            self.anchor.add_(buffer[:n])
        with torch.no_grad():
            _unflatten(self.anchor, [local_part(p) for p in trainer.params])
            if finite:
                for i, parts in enumerate(vectors.values()):
                    _unflatten(buffer[(i + 1) * n : (i + 2) * n], parts)
        self.round_closed(loss_sum, loss_count, elapsed_sum / self.ctx.world_size)
        moved = ring_allreduce_bytes(totals.numel() * totals.element_size(), self.ctx.world_size)
        stats = CommStats(bytes_sent=moved, bytes_received=moved, nonfinite=None if finite else True).add(traffic)
        stats.seconds = time.perf_counter() - t0
        return stats


def state_vectors(trainer: ShardedTrainer) -> dict[str, list[torch.Tensor]]:
    """The optimizer's per-parameter state vectors (SGD's momentum, Adam's moments), as this worker's
    local parts, by state name, in parameter order; scalars (Adam's step) are the same on every worker."""
    import torch

    from distrain.trainers.optim_state import SCALAR_STATE
    from distrain.trainers.sharded_trainer import local_part

    assert trainer.optimizer is not None
    pairs = [(trainer.optimizer.state.get(p, {}), p) for p in trainer.params]
    if not all(state for state, _ in pairs):
        return {}  # before the first step: no state yet

    def is_vector(key: str) -> bool:  # one value per parameter value, on every tensor
        whole = all(torch.is_tensor(s.get(key)) and s[key].shape == p.shape for s, p in pairs)
        return whole and key not in SCALAR_STATE

    return {key: [local_part(s[key]) for s, _ in pairs] for key in pairs[0][0] if is_vector(key)}


def _flat(parts: list[Any]) -> torch.Tensor:
    import torch

    from distrain.trainers.sharded_trainer import local_part

    return torch.cat([local_part(t.detach()).reshape(-1) for t in parts])


def _unflatten(flat: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Copy `flat` into the local tensors `parts`, in order."""
    offset = 0
    for part in parts:
        part.copy_(flat[offset : offset + part.numel()].view_as(part))
        offset += part.numel()
