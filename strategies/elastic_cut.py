"""Elastic membership across cut replicas (`--fsdp D` and/or `--tensor-parallel T`, `--workers MIN..MAX`,
over the collective transport; issue 28): what BSP (strategies/elastic_sharded_bsp.py), local SGD and
DiLoCo (here; config/layout_section.py `check_elastic_layout`) share there, --precision and the cnn's hybrid
plan included, and the block logic local SGD and DiLoCo share.

Slots are replicas: replica r's D x T workers are consecutive actor ranks, rank = (replica x D + d) x T +
t (orchestrator/membership.py places one group of bundles per replica), and a worker lost takes its whole
replica out (orchestrator/controller/collective_scaling.py). The books are elastic BSP's
(orchestrator/rounds.py) over MAX x D slices a step, one unit per data-parallel rank per round (its T
workers take it together: `RoundPlan.share`; under a hybrid plan each of them its own, MAX x D x T slices),
so a round of R' replicas is R' x D units; a worker with no unit in a round (a placeholder) still runs its
forward and backward at loss weight 0, since FSDP's and tensor parallelism's collectives need every worker
of the mesh.

A re-form (`TrainWorker.reform` with `rebuilds_replica`, orchestrator/worker.py): every member joins the
new group, makes the (R', D, T) mesh ("replicate", "shard", "tp") and a fresh trainer cut over it (`cut`:
FSDP2 cannot be moved to another mesh; the strategy makes its own pieces over it too, `made`), puts its
own pieces back (trainers/replica_shards.py; D and T do not change, so worker (d, t)'s pieces keep their
layout, fp16's loss scale with them) and takes those of the source replica's worker (d, t) by a broadcast
over the mesh's "replicate" group, the strategy's own pieces with them (`local_extra`: DiLoCo's outer
optimizer state, local SGD's books, the rounds so far). Nothing is read from disk. Then `reformed`: the
strategy's books start from that state.

Checkpoints and evaluations come from one replica: its workers evaluate the whole test set together
(worker (0, 0) returns the scores) and gather the whole state (`whole_state`), so the driver writes the
layout-free checkpoint every reader takes; no worker writes checkpoint shards.

Local SGD and DiLoCo (`ElasticCutBlocks`): as over plain replicas (strategies/local_sgd.py `ElasticLocalSGD`,
strategies/diloco.py `ElasticDiLoCo`) the driver deals blocks of τ (H) rounds ending in the block's
averaging (outer) round (`settle`), the only place the group re-forms. FSDP and tensor parallelism span
each replica's own D x T workers (as at a fixed size: strategies/sharded_local_sgd.py, sharded_diloco.py);
a local (inner) step is the replica's own, on its units of the round: one all-reduce inside the replica
(`replica_group`) of [workers with a unit, gradient sum] makes FSDP's mean over its D workers the mean
over its real units (a replica whose workers all sit the round out takes no step) and decides finiteness
for the replica (under fp16 a second all-reduce over the run decides whether the gradient overflowed, for
every member alike, so every loss scale moves alike), and the rate is the members' global batch's
(`lr_factor` of R' x D units out of MAX x D, as plain elastic local SGD's N'/MAX). The round averages each
worker's part over the R' workers holding the same part (d, t) in the other replicas (the "replicate"
group, as at a fixed size), weighted by whether its replica took a step in the block. A failed collective
(FSDP's or tensor parallelism's inside a replica whose mate is gone, or the round across replicas) raises
`GroupBroken`: the block is undone on every survivor (back to the block's start, `block_start`:
parameters, inner optimizer state and fp16's scale; DiLoCo's θ_g and outer state are unchanged until the
round succeeds) and its units are redone after the re-form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats, Strategy
from distrain.strategies.elastic_group import GroupBroken, ReformedGroup, book_round, lr_factor
from distrain.strategies.sharded_bsp import SHARDED_COLUMNS, fsdp_bytes_per_step
from distrain.strategies.sharded_diloco import ShardedDiLoCo
from distrain.strategies.sharded_local_sgd import ShardedLocalSGD, _flat, _unflatten, state_vectors
from distrain.trainers.shares import ShareTally, block_weight

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.strategies.base import StrategyContext
    from distrain.trainers.sharded_trainer import ShardedTrainer

COLLECTIVE_ERRORS = (RuntimeError, OSError)  # what torch.distributed raises when a peer is gone


class ElasticCut(ReformedGroup):
    """Mixed in before a cut replica's strategy (ShardedBSP and its subclasses): the group, the mesh and the
    trainer's cut made at every re-form, the placeholder's pass, evaluations and state from one replica."""

    elastic = True
    metric_columns = SHARDED_COLUMNS | {"members": "int32"}  # members: the group's workers in the row's round
    rebuilds_replica = True  # a re-form makes a fresh trainer cut over the new mesh (TrainWorker.reform)
    sits_out_on_a_batch = True  # a placeholder round still runs FSDP's collectives (TrainWorker.run_segment)
    plan = Strategy.plan  # the units as dealt: slice = one of MAX x D (and the worker prefetches the next)
    codes_gradients = False  # --compress is refused with a range
    # (the mixed-in strategy's) FSDP over every live replica (BSP: HSDP) or each replica's own D (local steps)
    fsdp_across_replicas: bool
    shards: int
    tp: int
    own_samples: bool
    config: RunConfig
    ctx: StrategyContext
    traffic: int
    update_group: Any

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)  # type: ignore[call-arg]
        self.weight = 0.0  # this worker's share of the round: 1 for a unit, 0 sitting one out
        # --balance speed: every round is one whole step of B cut among the member replicas by their shares
        # (orchestrator/elastic_balance.py, rounds.py `StepRoundPlan`); `share_weight`: this worker's
        # replica's b_r / B (`weigh_share`).
        self.balanced = config.balance == "speed"
        self.share_weight = 1.0
        self.mesh: Any = None
        self.live_replicas = 0

    @property
    def slices_per_step(self) -> int:
        """MAX x D, whoever is there (a data-parallel rank's T workers share its slice); under a hybrid
        plan (the cnn's: each tensor-parallel worker on its own samples) MAX x D x T."""
        return self.config.worker_slots * self.shards * (self.tp if self.own_samples else 1)

    @property
    def workers_per_unit(self) -> int:
        """The workers that take one unit together: a data-parallel rank's T (1 under a hybrid plan)."""
        return 1 if self.own_samples else self.tp

    def setup(self, trainer: ShardedTrainer) -> None:
        """No group yet: the driver forms one among the members (`reform`) before the first round."""

    def cut(self, trainer: ShardedTrainer, size: int) -> Any:
        """After `reform`: the (R', D, T) mesh of this group's `size` workers, `trainer` cut over it (the
        task's plan over "tp", then FSDP over the R' x D data-parallel workers, or each replica's D), and the
        strategy's own pieces made over it (`made`). (T > 1 under BSP only: config/layout_section.py.)"""
        self.live_replicas = size // (self.shards * self.tp)
        self.mesh = self.channel.device_mesh((self.live_replicas, self.shards, self.tp), ("replicate", "shard", "tp"))
        reshard = self.config.reshard_after_forward
        trainer.shard(self.mesh, reshard, across_replicas=self.fsdp_across_replicas, own_samples=self.own_samples)
        # The workers one update's gradient spans (None: all of them, HSDP; else the replica's own D x T, local
        # steps under local SGD and DiLoCo) and those holding this worker's part in the other replicas (a
        # round's average).
        self.update_group = None if self.fsdp_across_replicas else self.replica_group()
        self.across = self.mesh["replicate"].get_group()
        fsdp_replicas = self.live_replicas if self.fsdp_across_replicas else 1
        gathered = trainer.tp_numel * (2 if self.config.precision != "fp32" else 4)  # FSDP's param_dtype
        self.traffic = fsdp_bytes_per_step(trainer.tp_numel * 4, fsdp_replicas, self.shards, reshard, gathered)
        if trainer.hybrid is not None:  # its whole parameters' gradients, ring all-reduced over the T workers
            self.traffic += 2 * (self.tp - 1) * trainer.hybrid.numel(trainer.model) * 4 // self.tp
        self.made(trainer)
        return self.mesh

    def replica_group(self) -> Any:
        """This worker's replica's D x T workers (its local steps' group): the mesh's "shard" dimension when
        T = 1; else a group per replica, every member making every replica's in one order (torch requires
        it), with the run's --collective-timeout-s."""
        import torch.distributed as dist

        if self.tp == 1:
            return self.mesh["shard"].get_group()
        per = self.shards * self.tp  # rank = (replica x D + d) x T + t: a replica's workers are consecutive
        groups = [self.channel.subgroup(list(range(r * per, (r + 1) * per))) for r in range(self.live_replicas)]
        return groups[dist.get_rank() // per]

    def made(self, trainer: ShardedTrainer) -> None:
        """The strategy's own pieces over the new mesh (before any state is put in)."""

    def reformed(self, trainer: ShardedTrainer) -> None:
        """After the re-form's copy: the strategy's books start from the state every member now holds."""

    def local_extra(self) -> dict[str, Any]:
        """This worker's pieces of the strategy's own state that a joiner's worker (d, t) takes from live
        worker (d, t) (on the CPU; no collective)."""
        return {}

    def load_local_extra(self, state: dict[str, Any]) -> None:
        """Put `local_extra`'s pieces back (after `made`)."""

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """--balance speed: this worker reads `samples` = b_r / D of the step's B (b_r / (D x T) under a
        hybrid plan), so its replica took b_r (the row's `replica_samples`); BSP weighs its part of the
        replica's mean gradient by b_r / B (`share_weight`), local SGD and DiLoCo count the samples for the
        block's average (their tallies)."""
        super().weigh_share(samples, step_samples)  # type: ignore[misc]
        self.share_weight = self.replica_samples / step_samples  # type: ignore[attr-defined]

    def compute_gradients(self, trainer: ShardedTrainer, batch: Any) -> float:
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
        except COLLECTIVE_ERRORS as e:  # FSDP's all-gather or reduce-scatter: a peer gone
            raise GroupBroken(str(e)) from e

    # ------------------------------------------------------------------ evaluation and state: one replica
    def eval_share(self, shard: int, num_shards: int) -> tuple[int, int]:
        """The share the driver asks for (an elastic run's: the whole test set, on one replica's D workers)."""
        return shard, num_shards

    def checkpoint_shards(self, trainer: ShardedTrainer, step: int, directory: Any) -> None:
        """No shards written: the driver writes the whole state one replica gathers (`export_state`)."""
        return None

    def export_state(self, trainer: ShardedTrainer) -> dict[str, Any]:
        """The replica's whole state, gathered by its D x T workers together; worker (0, 0)'s is the answer."""
        from distrain.trainers.replica_shards import whole_state

        state = whole_state(trainer)
        return state if self.shard == 0 and self.tp_rank == 0 else {}  # type: ignore[attr-defined]


class ElasticCutBlocks(ElasticCut):
    """Local SGD's and DiLoCo's blocks across cut replicas under a range (the module docstring): the
    replica's own local steps, the block's start kept to undo it, the round's weight."""

    fsdp_across_replicas = False  # the local steps are each replica's own
    channel: Any
    trainer: Any

    def made(self, trainer: ShardedTrainer) -> None:
        self.trainer = trainer

    def reformed(self, trainer: ShardedTrainer) -> None:
        self.begin_block()

    def begin_block(self) -> None:
        """The block starts here: its state kept (this worker's pieces, the inner optimizer's included)."""
        from distrain.trainers.replica_shards import local_state

        self.block_start = local_state(self.trainer)
        self.took = 0  # local steps the replica took in this block
        self.fresh_tally()  # --balance speed: the samples taken in this block count afresh

    def undo_block(self) -> None:
        """Nothing of the block stands: back to its start."""
        from distrain.trainers.replica_shards import load_local

        load_local(self.trainer, self.block_start)
        self.took = 0
        self.fresh_tally()

    def fresh_tally(self) -> None:
        """The block's sample tally (`block_tally`) starts at zero."""
        raise NotImplementedError

    def block_tally(self) -> ShareTally:
        """The samples this worker took in the block (its b_r / D a step), under --balance speed."""
        raise NotImplementedError

    def local_step(self, trainer: ShardedTrainer, lr: float) -> CommStats:
        """The replica's own step on its units of this round (this worker's, or a placeholder's weight 0)."""
        import time

        import torch
        import torch.distributed as dist

        from distrain.trainers.sharded_trainer import local_part

        assert self.channel.joined, "reform() must run before step()"
        trainer.unscale_grads_()  # --precision fp16: the reduced gradient, divided by the loss scale
        t0 = time.perf_counter()
        size = self.channel.world_size
        device = "cuda" if self.ctx.device.startswith("cuda") else "cpu"
        buffer = torch.tensor([self.weight, float(trainer.local_grad_sum())], dtype=torch.float64, device=device)
        total = buffer[1:].clone()
        try:
            dist.all_reduce(buffer, group=self.update_group)  # the replica's D x T workers: one decision
            if trainer.scaler is not None:
                # fp16: whether a gradient overflowed is one answer over the run, which every member takes, its
                # replica stepping this round or not, so every member's loss scale moves alike (the scale a
                # checkpoint records and a re-form hands a joiner), as at a fixed size (sharded_bsp.py `step`).
                dist.all_reduce(total)
        except COLLECTIVE_ERRORS as e:
            raise GroupBroken(str(e)) from e
        ok = bool(torch.isfinite(total if trainer.scaler is not None else buffer[1]))
        # Σw counts the replica's workers with a unit; a unit is a data-parallel rank's, taken by its T
        # workers together (each of them under a hybrid plan).
        weights = int(round(float(buffer[0])))
        stats = CommStats(extra=self.layout_columns(trainer) | {"members": size})  # type: ignore[attr-defined]
        if weights == 0:  # the whole replica sits this round out: no step
            if trainer.scaler is not None:  # (its scale moves as every member's)
                self.gradient_decision(trainer.scaler, ok, "reduced gradient")  # type: ignore[attr-defined]
            stats.seconds = time.perf_counter() - t0
            return stats
        per = self.shards * self.tp
        if weights != per:
            # FSDP's mean is over the D workers (a hybrid's HybridGradients' over the T workers' too); the
            # placeholders' zeros are no samples: x D x T / Σw (= D / units where a unit is T workers').
            for p in trainer.params:
                if p.grad is not None:
                    local_part(p.grad).mul_(per / weights)
        c = self.config
        units = size // self.workers_per_unit  # the round's R' x D units (x T under a hybrid plan)
        # --balance speed: every round is a whole step of B cut among the members (the rate unscaled)
        factor = (
            1.0
            if self.balanced
            else lr_factor(units, self.slices_per_step, c.batch_size, c.base_batch_size, c.lr_scaling)
        )
        stats.lr = lr * factor
        try:
            trainer.clip_gradient_(self.update_group)
        except COLLECTIVE_ERRORS as e:
            raise GroupBroken(str(e)) from e
        stats.seconds = time.perf_counter() - t0
        stats.bytes_sent = stats.bytes_received = self.traffic
        # (fp16: an overflow is skipped by every member alike and halves every member's scale.)
        if self.gradient_decision(trainer.scaler, ok, "reduced gradient"):  # type: ignore[attr-defined]
            trainer.apply_update(stats.lr)
            self.took += 1
        else:
            stats.nonfinite = True
        return stats

    def at_epoch_end(self, trainer: ShardedTrainer) -> CommStats | None:
        return None  # blocks never cross an epoch or a step checkpoint: `settle` closes each

    def settle(self, rows: dict[str, list[Any]]) -> None:
        """The block's round: this worker's values (`round_values`) summed over the replicas (`weighted_sum`),
        then applied (`apply_round`). A segment already broken (FSDP's collectives lost a peer) still takes
        part in the round's collectives at weight 0, so a live peer waiting in them is not held until a
        timeout (the run-wide finiteness all-reduce fails on the lost worker for everyone), then undoes the
        block; a round that fails undoes it too. Either way it leaves the broken group and raises
        GroupBroken: the block is redone after the re-form."""
        broken = rows["broken"][0]["error"] if "broken" in rows else None
        if broken is not None:
            self.undo_block()  # took = 0: weight 0 in the round
        try:
            sums, members, traffic = self.weighted_sum(*self.round_values())
        except COLLECTIVE_ERRORS as e:
            self.abandon()
            raise GroupBroken(str(e)) from e
        if broken is not None:
            self.abandon()
            raise GroupBroken(broken)
        rounds = self.apply_round(sums, members)
        self.begin_block()
        book_round(rows, traffic, rounds)

    def abandon(self) -> None:
        self.undo_block()
        self.channel.leave(quiet=True)

    def round_values(self) -> tuple[str, list[Any]]:
        """The round's stream and this worker's values (its parts, flat)."""
        raise NotImplementedError

    def apply_round(self, sums: Any, members: float) -> int:
        """Apply the round's weighted sums over `members` (None: not finite, skipped); returns the rounds so far."""
        raise NotImplementedError

    def weighted_sum(self, stream: str, values: list[Any]) -> tuple[Any, float, Any]:
        """Σ w x values and Σ w over the R' workers holding this worker's part (w = 1 if the replica took a
        step in the block; under --balance speed the samples this worker took in it, b_r / D a step, so the
        average weighs each replica by its samples, `block_weight`), and whether every worker of the run
        holds finite sums: (sums, Σ w, traffic)."""
        import torch
        import torch.distributed as dist

        w = block_weight(self.balanced, self.block_tally(), self.took)
        device = values[0].device
        buffer = torch.cat([*(v * w for v in values), torch.tensor([w], dtype=values[0].dtype, device=device)])
        traffic = self.channel.all_reduce(stream, buffer, op="sum", subgroup=self.across)
        broken = torch.tensor([0.0 if bool(buffer.isfinite().all()) else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(broken)  # every worker of the run: one decision
        members = float(buffer[-1])
        finite = self.finite(float(broken) == 0, "averaged parameters")  # type: ignore[attr-defined]
        return (buffer[:-1] if finite else None), members, traffic


class ElasticShardedLocalSGD(ElasticCutBlocks, ShardedLocalSGD):
    """Local SGD across cut replicas under --workers MIN..MAX (the module docstring): each worker's part of
    θ's change since the last average and of the inner optimizer's state vectors, averaged over the replicas
    that took a step in the block."""

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        """τ, as plain elastic local SGD's blocks (strategies/local_sgd.py `ElasticLocalSGD`)."""
        tau = config.options_of("local-sgd").tau
        assert tau is not None
        return tau

    def reformed(self, trainer: ShardedTrainer) -> None:
        self.anchor = _flat(trainer.params).clone()  # the last average: what every member holds
        self.pending = 0
        super().reformed(trainer)

    def local_extra(self) -> dict[str, Any]:
        return self.books()

    def load_local_extra(self, state: dict[str, Any]) -> None:
        self.load_books(state)

    def books(self) -> dict[str, Any]:
        """τ and the rounds so far (LocalPeriods' state; AdaComm is refused with a range)."""
        return {"tau": self.tau, "rounds": self.rounds}

    def load_books(self, state: dict[str, Any]) -> None:
        self.tau, self.rounds = int(state["tau"]), int(state["rounds"])

    def fresh_tally(self) -> None:
        self.tally = ShareTally()

    def block_tally(self) -> ShareTally:
        return self.tally

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        stats = self.local_step(trainer, lr)
        stats.period, stats.averaging_round = self.tau, self.rounds
        return stats

    def round_values(self) -> tuple[str, list[Any]]:
        self.vectors = state_vectors(self.trainer)
        return "params", [_flat(self.trainer.params) - self.anchor, *(_flat(p) for p in self.vectors.values())]

    def apply_round(self, sums: Any, members: float) -> int:
        import torch

        n = self.anchor.numel()
        if sums is not None and members > 0:
            sums.div_(members)
            self.anchor.add_(sums[:n])
        with torch.no_grad():
            _unflatten(self.anchor, [_local(p) for p in self.trainer.params])
            if sums is not None and members > 0:
                for i, parts in enumerate(self.vectors.values()):
                    _unflatten(sums[(i + 1) * n : (i + 2) * n], parts)
        self.rounds += 1
        self.pending = 0
        return self.rounds


class ElasticShardedDiLoCo(ElasticCutBlocks, ShardedDiLoCo):
    """DiLoCo across cut replicas under --workers MIN..MAX (the module docstring): one fragment (Streaming
    DiLoCo is refused with a range); each worker's part of θ_g − θ_i averaged over the replicas that took
    an inner step in the block, the outer optimizer stepping each worker's part of θ_g alike. A joiner's
    worker (d, t) takes live worker (d, t)'s θ_g (the parameters, at a block boundary), inner and outer optimizer
    state."""

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        """H, as plain elastic DiLoCo's blocks (strategies/diloco.py `ElasticDiLoCo`)."""
        return config.options_of("diloco").sync_every

    def made(self, trainer: ShardedTrainer) -> None:
        super().made(trainer)
        self.make_fragments(trainer)  # θ_g and the outer optimizer over the new mesh's parts
        pending, self.pending_extra = getattr(self, "pending_extra", None), None
        if pending is not None:  # a checkpoint's outer state (a restart), read before there was a mesh
            ShardedDiLoCo.load_extra_state(self, pending)

    def reformed(self, trainer: ShardedTrainer) -> None:
        import torch

        from distrain.trainers.sharded_trainer import local_part

        with torch.no_grad():  # θ_g: the parameters every member holds at a block boundary
            for g, p in zip(self.globals, trainer.params, strict=True):
                local_part(g).copy_(local_part(p))
        super().reformed(trainer)

    def local_extra(self) -> dict[str, Any]:
        from distrain.trainers.replica_shards import optimizer_pieces

        (f,) = self.fragments
        return {"outer_steps": self.outer_steps, "outer": optimizer_pieces(f.outer, f.params, self.names_of(f))}

    def load_local_extra(self, state: dict[str, Any]) -> None:
        from distrain.trainers.replica_shards import load_optimizer_pieces

        (f,) = self.fragments
        self.outer_steps = int(state["outer_steps"])
        load_optimizer_pieces(f.outer, f.params, self.names_of(f), state["outer"])

    def extra_state(self) -> dict[str, Any] | None:
        """For the driver's layout-free checkpoint: the outer optimizer's whole state in plain DiLoCo's flat
        form, gathered inside the replica (its D x T workers call this together)."""
        from torch.distributed.tensor import DTensor

        from distrain.trainers.optim_state import export_flat_state

        (f,) = self.fragments
        flat = export_flat_state(f.outer, f.params, lambda v: v.full_tensor() if isinstance(v, DTensor) else v)
        return {"outer_steps": self.outer_steps, "outer_optimizer": flat.to_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's (a restart from it): read once the mesh is made (`made`)."""
        if self.fragments:
            ShardedDiLoCo.load_extra_state(self, state)
        else:
            self.pending_extra = state

    def fresh_tally(self) -> None:
        self.tallies = [ShareTally()]

    def block_tally(self) -> ShareTally:
        return self.tallies[0]

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        stats = self.local_step(trainer, lr)
        stats.period, stats.averaging_round = self.options.sync_every, self.outer_steps
        return stats

    def round_values(self) -> tuple[str, list[Any]]:
        (f,) = self.fragments
        return f.stream, [self.pseudo_gradient(f, self.trainer)]

    def apply_round(self, sums: Any, members: float) -> int:
        (f,) = self.fragments
        if members > 0:
            if sums is not None:
                self.outer_step(f, sums.div_(members))
            self.outer_steps += 1
        self.mix(f, self.trainer, 0.0)  # every member continues from θ_g
        return self.outer_steps


def _local(p: Any) -> Any:
    from distrain.trainers.sharded_trainer import local_part

    return local_part(p)
