"""DiLoCo across cut replicas (`--strategy diloco --fsdp D` and/or `--tensor-parallel T`;
`DiLoCo.implementation` picks it): the inner steps are each replica's own FSDP (and TP) steps, the outer
step works shard by shard.

Each replica's D x T workers run FSDP over the replica's "shard" dimension only (no HSDP: nothing
crosses replicas during the inner steps), so after H inner steps replica i holds θ_i cut the same way
on every replica. Every worker keeps θ_g for its own part, as DTensors shaped like its parameters, with
the outer optimizer over them; the pseudo-gradient of its part, θ_g − θ_i, is averaged over the R
workers that hold the same part in the other replicas (the mesh's "replicate" group) and the outer
optimizer steps it. So a round moves 1/(D x T) of the model per worker, and no worker ever holds the
whole model or its whole pseudo-gradient. Under --compress the part's pseudo-gradient goes through the
channel's codec over that group (the "pseudo_grads" stream: error feedback per worker, PowerSGD on each
part as a matrix). Unequal replica shares (--worker-weights, --balance speed): each replica's inner steps
take its own b_r samples (cut equally among its D ranks), and each part's pseudo-gradient is weighted by
the samples its replica trained on since the last outer step (`ShareTally`, as plain DiLoCo weighs
fragments), so the outer gradient is the samples-weighted mean. Streaming DiLoCo (--fragments,
--overlap-steps) and elastic membership are not built across cut replicas (DiLoCoOptions.check refuses
them).

Checkpoints: a period ends at every checkpoint, so θ_g is the model there; each worker writes its part of
the outer optimizer's state beside its model shards (`checkpoint_entries`), and a run at any layout reads
its own parts back (`load_extra_state`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from distrain.strategies.adacomm import outer_steps_figure
from distrain.strategies.base import CommStats, StrategyContext
from distrain.strategies.sharded_bsp import ShardedBSP, local_shapes
from distrain.trainers.shares import ShareTally

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.trainers.sharded_trainer import ShardedTrainer


OUTER = "outer"  # the outer optimizer's entries in a sharded checkpoint (trainers/sharded_checkpoint.py)


class ShardedDiLoCo(ShardedBSP):
    name = "diloco"
    fsdp_across_replicas = False  # the inner steps are each replica's own
    codes_gradients = False

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)  # self.options: DiLoCo's (this class's name)
        self.t = 0  # inner steps since the last outer step
        self.outer_steps = 0
        self.tally = ShareTally()  # unequal shares: the samples this worker took since the last outer step

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        return super().summary_figures(steps) | outer_steps_figure(steps)

    def setup(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        import torch

        mesh = self.join_mesh(trainer)
        self.across = mesh["replicate"].get_group()  # the workers holding this worker's part elsewhere
        self.trainer = trainer
        # θ_g: this worker's part of every parameter (DTensors, as the parameters), with its outer optimizer.
        self.globals = [torch.nn.Parameter(p.detach().clone()) for p in trainer.params]
        self.outer = self.options.make_outer_optimizer(self.globals)
        # The pseudo-gradient of this worker's part (under --compress through the codec: PowerSGD on each part).
        self.channel.open("pseudo_grads", shapes=local_shapes(trainer.params), group=self.across)

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        stats = super().step(trainer, lr)  # the inner step: the replica's own FSDP step
        self.t += 1
        if self.t % self.options.sync_every == 0:
            stats = self._outer_step(stats)
        stats.period = self.options.sync_every
        stats.averaging_round = self.outer_steps
        return stats

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """Unequal replica shares: the pseudo-gradient of this worker's part is weighted by the samples it
        took since the last outer step (`ShareTally`: its replica's mean b_r x R / B over the period)."""
        self.replica_samples = samples * self.share_cut
        self.tally.add(samples, step_samples)

    def at_epoch_end(self, trainer: ShardedTrainer) -> CommStats | None:  # type: ignore[override]
        """Close the period: an outer step if inner steps were taken since the last."""
        stats = self._outer_step(CommStats()) if self.t > 0 else CommStats()
        stats.averaging_round = self.outer_steps
        return stats

    def _outer_step(self, stats: CommStats) -> CommStats:
        """Average this part's pseudo-gradient θ_g − θ_i across the replicas, step the outer optimizer on
        it, and start the replica from the new θ_g."""
        import torch
        import torch.distributed as dist

        from distrain.trainers.sharded_trainer import local_part

        t0 = time.perf_counter()
        pairs = zip(self.globals, self.trainer.params, strict=True)
        deltas = [local_part(g.detach()) - local_part(p.detach()) for g, p in pairs]
        flat = torch.cat([d.reshape(-1) for d in deltas])
        weight = self.tally.take(self.slices_per_step)  # 1 with equal shares
        if weight != 1.0:
            flat.mul_(weight)
        traffic = self.channel.all_reduce("pseudo_grads", flat)
        total = flat.sum().reshape(1).double()
        dist.all_reduce(total)  # every worker decides alike
        if self.finite(bool(total.isfinite()), "averaged pseudo-gradient"):
            offset = 0
            for g in self.globals:
                part = local_part(g)
                g.grad = _like(g, flat[offset : offset + part.numel()].view_as(part))
                offset += part.numel()
            self.outer.step()
            for g in self.globals:
                g.grad = None
        else:
            stats.nonfinite = True
        with torch.no_grad():
            for g, p in zip(self.globals, self.trainer.params, strict=True):
                local_part(p).copy_(local_part(g))
        self.t = 0
        self.outer_steps += 1
        stats.add(traffic)
        stats.seconds += time.perf_counter() - t0 - traffic.seconds
        return stats

    # ------------------------------------------------------------------ state
    def checkpoint_entries(self, trainer: ShardedTrainer) -> dict[str, Any]:
        """The outer optimizer's state, each worker its part (θ_g is the model at a period's end)."""
        from distrain.trainers.sharded_checkpoint import optimizer_entries

        return optimizer_entries(self.outer, self.globals, trainer.names, OUTER)

    def extra_state(self) -> dict[str, Any] | None:
        """The outer steps; the outer optimizer's state is in the checkpoint's shards, under OUTER."""
        return {"outer_steps": self.outer_steps, "outer_optimizer": {"sharded": OUTER}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """From a sharded checkpoint (each worker reads its part) or a whole one (each cuts its part)."""
        from distrain.trainers.optim_state import FlatOptimizerState, import_flat_state
        from distrain.trainers.sharded_checkpoint import load_optimizer_entries
        from distrain.trainers.sharded_trainer import shard_of

        self.outer_steps = int(state["outer_steps"])
        outer = state["outer_optimizer"]
        if "sharded" in outer:
            assert self.trainer.loaded_from is not None, "a sharded strategy state comes with sharded shards"
            load_optimizer_entries(self.outer, self.globals, self.trainer.names, self.trainer.loaded_from, OUTER)
        else:
            import_flat_state(self.outer, self.globals, FlatOptimizerState.from_dict(outer), shard_of)


def _like(param: Any, local: Any) -> Any:
    """`local` as `param`'s gradient: a DTensor placed as `param` is, or the plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return local
