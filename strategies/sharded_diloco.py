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
take its own b_r samples (cut equally among its D ranks), and each fragment's part of the pseudo-gradient
is weighted by the samples its replica trained on since that fragment's last sync (`ShareTally`, one per
fragment, as plain DiLoCo weighs fragments), so the outer gradient is the samples-weighted mean. Under
--workers MIN..MAX: strategies/elastic_cut.py (`ElasticShardedDiLoCo`).

Streaming DiLoCo (--fragments P, --overlap-steps τ, --mix-alpha α) is plain DiLoCo's code
(`FragmentRounds`, strategies/fragments.py: the schedule t mod H = p·H/P, the background all-reduce
completed τ steps later, the mix, the close of a period); this class says only what a cut replica's θ
is. A fragment is a set of whole tensors, cut by the whole tensors' sizes (`fragment_plan`; a DTensor's
numel is its whole tensor's), so fragments are the same on every worker and on plain replicas, and each
worker holds its part of each of the fragment's tensors: its θ_g parts with the fragment's outer
optimizer over them, and the fragment's stream ("pseudo_grads.p"; "pseudo_grads" for one fragment) over
the "replicate" group. Whether a fragment's mean is finite is decided run-wide, so all of it steps or
none. One fragment, τ = 0, α = 0 is DiLoCo across cut replicas as it was.

Checkpoints: a period ends at every checkpoint, so θ_g is the model there; each worker writes its part of
every fragment's outer optimizer state beside its model shards (`checkpoint_entries`, under the names one
optimizer over every parameter would use), and a run at any layout reads its own parts back
(`load_extra_state`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrain.strategies.adacomm import outer_steps_figure
from distrain.strategies.base import CommStats, StrategyContext
from distrain.strategies.fragments import Fragment, FragmentRounds, fragment_plan, fragment_stream
from distrain.strategies.sharded_bsp import ShardedBSP, local_shapes
from distrain.trainers.shares import ShareTally

if TYPE_CHECKING:
    import torch

    from distrain.config import RunConfig
    from distrain.strategies.diloco import DiLoCoOptions
    from distrain.trainers.sharded_trainer import ShardedTrainer


OUTER = "outer"  # the outer optimizer's entries in a sharded checkpoint (trainers/sharded_checkpoint.py)


class ShardedDiLoCo(FragmentRounds, ShardedBSP):
    name = "diloco"
    fsdp_across_replicas = False  # the inner steps are each replica's own
    codes_gradients = False

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)  # self.options: DiLoCo's (this class's name)
        self.start_rounds()  # fragments, t, outer steps: DiLoCo's books (strategies/diloco.py)

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        return super().summary_figures(steps) | outer_steps_figure(steps)

    def setup(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        mesh = self.join_mesh(trainer)
        self.across = mesh["replicate"].get_group()  # the workers holding this worker's part elsewhere
        self.make_fragments(trainer)
        # Each fragment's pseudo-gradient is a stream of its own over the "replicate" group (under --compress
        # through the codec: this worker's error feedback, PowerSGD on each part as a matrix).
        for p, f in enumerate(self.fragments):
            f.stream = fragment_stream(p, len(self.fragments))
            self.channel.open(f.stream, shapes=local_shapes(f.params), group=self.across)

    def make_fragments(self, trainer: ShardedTrainer) -> None:
        """θ_g: this worker's part of every parameter (DTensors, as the parameters), fragment by fragment.
        The fragments are cut by the whole tensors' sizes (a DTensor's numel is its whole tensor's), so they
        are the same on every worker and those of a plain replica; each has its own outer optimizer over its
        tensors' parts. (Elastic: made afresh over each re-formed mesh, strategies/elastic_cut.py.)"""
        import torch

        self.trainer = trainer
        self.globals = [torch.nn.Parameter(p.detach().clone()) for p in trainer.params]
        o: DiLoCoOptions = self.options
        self.fragments = []
        for lo, hi, offset, tensors in fragment_plan([p.numel() for p in trainer.params], o.fragments, o.sync_every):
            parts = self.globals[tensors.start : tensors.stop]
            self.fragments.append(Fragment(lo, hi, offset, tensors, parts, o.make_outer_optimizer(parts)))
        self.tallies = [ShareTally() for _ in self.fragments]  # unequal shares: 1 with equal ones

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        stats = super().step(trainer, lr)  # the inner step: the replica's own FSDP step
        return self.after_inner_step(trainer, stats)

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """Unequal replica shares: each fragment's part of the pseudo-gradient is weighted by the samples this
        worker took since that fragment's last sync (`ShareTally`: its replica's mean b_r x R / B over them)."""
        self.replica_samples = samples * self.share_cut
        for tally in self.tallies:
            tally.add(samples, step_samples)

    def at_epoch_end(self, trainer: ShardedTrainer) -> CommStats | None:  # type: ignore[override]
        return self.close_period(trainer)

    # What a cut replica's θ is: each worker's parts of the fragment's tensors, averaged over the R workers
    # holding the same parts (the stream's group, the mesh's "replicate" dimension).
    def pseudo_gradient(self, f: Fragment, trainer: ShardedTrainer) -> torch.Tensor:
        import torch

        from distrain.trainers.sharded_trainer import local_part

        pairs = zip(f.params, trainer.params[f.tensors.start : f.tensors.stop], strict=True)
        return torch.cat([(local_part(g.detach()) - local_part(p.detach())).reshape(-1) for g, p in pairs])

    def agreed_finite(self, delta: torch.Tensor) -> bool:
        """Every worker holds another part: the sum over all of them decides for all."""
        import torch.distributed as dist

        total = delta.sum().reshape(1).double()
        dist.all_reduce(total)
        return bool(total.isfinite())

    def outer_step(self, f: Fragment, delta: torch.Tensor) -> None:
        from distrain.trainers.sharded_trainer import local_part

        offset = 0
        for g in f.params:
            part = local_part(g)
            g.grad = _like(g, delta[offset : offset + part.numel()].view_as(part))
            offset += part.numel()
        f.outer.step()
        for g in f.params:
            g.grad = None

    def mix(self, f: Fragment, trainer: ShardedTrainer, alpha: float) -> None:
        import torch

        from distrain.trainers.sharded_trainer import local_part

        with torch.no_grad():
            for g, p in zip(f.params, trainer.params[f.tensors.start : f.tensors.stop], strict=True):
                local = local_part(p)
                if alpha == 0:
                    local.copy_(local_part(g))
                else:
                    local.mul_(alpha).add_(local_part(g), alpha=1 - alpha)

    # ------------------------------------------------------------------ state
    def checkpoint_entries(self, trainer: ShardedTrainer) -> dict[str, Any]:
        """The outer optimizers' state, each worker its part (θ_g is the model at a period's end): the
        fragments' entries together are one optimizer's over every parameter."""
        from distrain.trainers.sharded_checkpoint import optimizer_entries

        entries: dict[str, Any] = {}
        # A per-optimizer number (Adam's step) is written once, fragment 0's, as plain DiLoCo's flat form
        # keeps it (FlatOptimizerState.concat); each fragment's own goes in `extra_state`.
        for f in reversed(self.fragments):
            entries |= optimizer_entries(f.outer, f.params, self.names_of(f), OUTER)
        return entries

    def extra_state(self) -> dict[str, Any] | None:
        """The outer steps and each fragment's own numbers (Adam's step); the outer optimizers' state is in the
        checkpoint's shards, under OUTER."""
        return {"outer_steps": self.outer_steps, "outer_optimizer": {"sharded": OUTER}} | self.fragment_scalars()

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """From a sharded checkpoint (each worker reads its part) or a whole one (each cuts its part of
        each fragment's span of DiLoCo's flat form)."""
        from distrain.trainers.optim_state import FlatOptimizerState, import_flat_state
        from distrain.trainers.sharded_checkpoint import load_optimizer_entries
        from distrain.trainers.sharded_trainer import shard_of

        self.outer_steps = int(state["outer_steps"])
        outer = state["outer_optimizer"]
        if "sharded" in outer:
            assert self.trainer.loaded_from is not None, "a sharded strategy state comes with sharded shards"
            for f in self.fragments:
                load_optimizer_entries(f.outer, f.params, self.names_of(f), self.trainer.loaded_from, OUTER)
        else:
            flat = FlatOptimizerState.from_dict(outer)
            for f in self.fragments:
                import_flat_state(f.outer, f.params, flat.slice(f.lo, f.hi) if flat.vectors else flat, shard_of)
        self.restore_fragment_scalars(state)

    def names_of(self, f: Fragment) -> list[str]:
        """The checkpoint's names of the fragment's parameters."""
        return self.trainer.names[f.tensors.start : f.tensors.stop]


def _like(param: Any, local: Any) -> Any:
    """`local` as `param`'s gradient: a DTensor placed as `param` is, or the plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return local
