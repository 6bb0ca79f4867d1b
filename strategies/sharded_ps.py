"""The parameter-server strategies across cut replicas (`--fsdp D` with async, ssp or bsp over
`--transport ps`; each strategy's `implementation` picks these): a sharded replica pushes its gradient
chunks to the PS shards that hold those slices, so no worker ever materialises the whole gradient.

The PS has exactly D shards and shard d holds FSDP chunk d of every parameter tensor, in order
(trainers/shard_layout.py: a permutation of the whole flat θ), which is exactly the local flat vector of
data-parallel rank d of every replica. Worker (r, d) runs its replica's FSDP step inside the replica only
(the mesh's "shard" dimension: all-gathers in forward and backward, a reduce-scatter that leaves it the
replica's mean gradient over its D x B samples, chunk d), flattens its local chunks, pushes them to PS
shard d alone and pulls θ chunk d back into its local parameter shards. Each shard's consistency rule
counts the R replicas (their rank-d workers, client id r), not the R x D workers: async and SSP apply
each replica's gradient at lr / R on arrival, BSP's rounds close on R gradients and apply their mean.

--tensor-parallel T: the PS has exactly T shards and shard t holds TP rank t's part of every tensor the
plan splits (its DTensor local shard: a colwise Linear's rows, a rowwise one's columns) and chunk t of
dim 0 (torch.chunk's cut) of every tensor the plan leaves whole (a rowwise layer's bias, the layers not
in the plan), in tensor order (trainers/shard_layout.py with a cut dimension per tensor; the driver asks a
worker for the plan's dimensions, `param_cut_dims`). The T workers of a replica compute one gradient on
one batch, the whole tensors' gradients alike on each, so TP rank t pushes its split parts and its rows
of the whole tensors: every value of the replica's gradient reaches the shards exactly once. It pulls θ
piece t back into its split parts, and the whole tensors are put together over the replica's T workers
(each its rows, zeros elsewhere, summed: exact), so all T hold them alike. Under the cnn's hybrid plan
(trainers/tensor_parallel.py: the T workers each on their own B samples, only the classifier split)
`HybridGradients` has made every gradient the mean over the T x B samples, the whole (convolution)
tensors' alike on the T workers, so the same pieces carry it.

--fsdp D with --tensor-parallel T: the PS has D x T shards, one per worker of a replica, and worker (d, t)
(rank d x T + t in the replica) pushes to and pulls from shard d x T + t exactly the piece it holds:
FSDP's chunk d (dim 0) of TP rank t's part of a split tensor (FSDP2 cuts the local tensor of the plan's
DTensor), and its rows t of FSDP's chunk d of a tensor the plan leaves whole (the T workers of
data-parallel rank d hold that chunk alike, FSDP's reduce-scatter over the D workers of one TP rank having
left each the replica's mean gradient over its D x B samples). The whole tensors' chunks are put together
over the T workers of data-parallel rank d, as above; the replica's decisions (a skip, an fp16 overflow,
k-of-n's round) are taken over its D x T workers.

State: the shards hold θ and the optimizer state; the workers' own optimizers are never stepped. A
checkpoint is the shards' snapshot, put back in the whole model's order (`export_state`), so it is a
whole checkpoint that loads at any layout; the driver builds the shards from a whole θ and optimizer
state (strategies/driver_actor.py `ps_shards`) in the shards' order. --precision: FSDP's mixed precision
inside the replica (trainers/sharded_trainer.py), the pushed chunks and the shards float32; under fp16
a replica's D workers agree on an overflow (`step`), each replica keeping its own scale, and a
checkpoint holds worker 0's.

Backup workers (bsp --backup-workers K, k-of-n, Chen et al. 2016): N + K replicas push, each round applies
the first N replicas' gradients. A replica's D pieces reach the D shards at different times, so the
shards do not decide apart (shard 0 could take replicas {0, 1} and shard 1 {0, 2}: a model whose chunks
had different updates): a replica counts once all D of its pieces have arrived, and one referee on PS
shard 0 decides each round's N for every shard (strategies/ps_shard.py `RoundReferee`). A replica whose
gradient was dropped skips the rounds that closed without it, with their data, as a plain backup worker
does; its D workers first agree on the round to go on at (the most advanced shard's version, an
all-reduce over the replica's group) and pull θ chunk d at it, so the replica's chunks are of one version
(`_agree_round`); under --workers MIN..MAX, see "Elastic" below. Backup tasks (--backup-tasks) under
--fsdp D at a fixed size: strategies/sharded_backup_tasks.py (a replica's D workers take each chunk of
portions together); not yet under --tensor-parallel or a range (config/layout_section.py). Not yet: worker
replacement in place at a fixed size (a replica's D workers share one FSDP group: a lost worker restarts
the attempt; under a range its replica leaves instead, below).

Elastic (`--workers MIN..MAX`; docs/elastic.md, "Sharded replicas over the PS"): MIN and MAX count
replicas, one placement group of D x T workers each, and the shards count one client per replica slot
(the driver's worker ranks mapped to it: orchestrator/controller/ray_group.py). A replica's D x T workers
join their own group (worker (d, t) is group rank d x T + t, at worker 0's rendezvous: the mesh's "shard"
and "tp" dimensions inside it), so replicas come and go without touching the others; a joiner's worker
(d, t) takes its piece from shard d x T + t at set-up (the optimizer state is on the shards: nothing to
copy from a live worker). The driver deals replica units (orchestrator/replica_dispatcher.py): worker
(d, t) trains slice s x D + d of the step's MAX x D, its T alike (each its own under a hybrid plan), as
dealt (`plan`). A lost
worker takes its replica out (orchestrator/controller/scaling.py). Under BSP (the elastic rule over MAX
replica slots: rounds close on the member replicas, the rate scaled for their count) a replica enters
the rounds where the driver puts it, its D workers agreeing on the round and pulling θ there
(`_enter_rounds`); async and SSP go on as at a fixed size, SSP's bound among the members' clocks.
The shards agree every elastic round through the referee on shard 0 (strategies/ps_shard.py), which
decides from shard 0's members: plain elastic rounds whose members' pieces have all arrived, or with
--backup-workers K (MIN > K) the first members - K member replicas whose every piece has arrived (a
leaver's pieces stop counting; a round without a member closes empty). A replica dropped there does
not skip units (they are shared, each computed once): its D x T workers agree on the round to go on at,
pull θ there (`_agree_round`) and compute their next unit on it, as a plain elastic backup worker does.

--compress: a worker's push goes through the channel (`Channel.push_pull` with this worker's one-shard
client), so its chunk is encoded with its own error-feedback residual, kept on the worker, and decoded by
the shard; pulls stay float32, and PowerSGD is refused (a shard holds a flat chunk). The residual is in
the channel's state, shipped per rank into checkpoints as for every strategy. Under --workers MIN..MAX a
leaver's residual leaves with it and a joiner's worker starts with a zero one: nothing agreed across replicas.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats
from distrain.strategies.consistency import ConsistencyRule, refuse_matrix_codec
from distrain.strategies.elastic_group import GroupBroken, peer_lost
from distrain.strategies.sharded_bsp import ShardedBSP

if TYPE_CHECKING:
    from distrain.compression import CodecSpec
    from distrain.config import RunConfig
    from distrain.trainers.sharded_trainer import ShardedTrainer


def whole_state_dict(trainer: ShardedTrainer, theta: Any) -> dict[str, Any]:
    """The model's whole state dict with its trainable parameters from the whole flat `theta` (a torch
    tensor in the parameters' order) and its buffers as this worker holds them (FSDP does not cut them)."""
    from torch.distributed.tensor import DTensor

    shapes = {name: p.shape for name, p in zip(trainer.names, trainer.params, strict=True)}
    offsets, offset = {}, 0
    for name, shape in shapes.items():
        offsets[name] = offset
        offset += math.prod(shape)
    state: dict[str, Any] = {}
    for key, value in trainer.model.state_dict().items():
        if key in shapes:
            start = offsets[key]
            state[key] = theta[start : start + math.prod(shapes[key])].view(shapes[key]).clone()
        elif isinstance(value, DTensor):
            raise RuntimeError(f"{key}: a frozen parameter cut by FSDP is not in the shards' θ")
        else:
            state[key] = value.detach().cpu().clone()
    return state


def tp_split_dim(p: Any) -> int | None:
    """The dimension a tensor-parallel plan split parameter `p` along (its DTensor's Shard placement on the
    mesh's "tp" dimension: under FSDP too, whose own placement is on "shard"), None for one the T workers
    hold whole (a plain tensor, a DTensor on FSDP's mesh alone, or one replicated over "tp")."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    names = p.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None
    placement = p.placements[names.index("tp")]
    return placement.dim if isinstance(placement, Shard) else None


class ShardedPS(ShardedBSP):
    """Worker (r, d) of a cut replica on the parameter server (the module docstring)."""

    transports = ("ps",)
    fsdp_across_replicas = False  # across replicas the shards combine the gradients
    codes_gradients = False
    elastic = True  # --workers MIN..MAX: whole replicas join and leave (the module docstring, "Elastic")

    def __init__(self, config: RunConfig, ctx: Any) -> None:
        super().__init__(config, ctx)
        self.clock = 0
        rule = self.ps_rule(config)
        self.rounds = rule.mode == "rounds"
        # backup workers (a fixed N + K, or K among the members of a range): a round may close without us
        self.k_of_n = self.rounds and (rule.accept is not None or rule.backups > 0)
        self.skip = 0  # units of rounds that closed without this replica (k-of-n)

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        """The unsharded strategy's rule (strategies/ps.py, bsp.py), over R clients."""
        raise NotImplementedError

    @classmethod
    def check_codec(cls, config: RunConfig, codec: CodecSpec) -> None:
        """As over the PS without sharding (strategies/ps.py): a shard holds a flat chunk, no matrices."""
        super().check_codec(config, codec)
        refuse_matrix_codec(codec, holds="a flat chunk of the parameters")

    def setup(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        import torch

        from distrain.strategies.channel import PS_WAIT_FACTOR, PS_WAIT_MARGIN_S
        from distrain.strategies.ps_client import PSClient
        from distrain.trainers.shard_layout import ShardLayout, chunk_rows
        from distrain.trainers.sharded_trainer import local_part

        if self.config.elastic:  # its own replica's group of D x T, at its worker 0's rendezvous (no run-wide one)
            self.channel.join(self.shard * self.tp + self.tp_rank, self.shards * self.tp, self.ctx.rendezvous)
        mesh = self.join_mesh(trainer)
        # This replica's D x T workers take its joint decisions over `update_group` (None where the run's group
        # is the replica); the T workers of its data-parallel rank hold the tensors the plan leaves whole
        # alike; this worker pushes and pulls the piece of every tensor at PS shard d x T + t, its rank in
        # the replica (trainers/shard_layout.py).
        self.tp_group = mesh["tp"].get_group() if self.tp > 1 else None
        self.piece = self.shard * self.tp + self.tp_rank
        self.trainer = trainer
        self.locals = [local_part(p) for p in trainer.params]
        # Under --tensor-parallel: the dimension each tensor is split along across the T workers (a DTensor's
        # Shard on the "tp" mesh dimension), and for a tensor the plan leaves whole the rows [lo, hi) of dim 0
        # of its local part (FSDP's chunk d of it, or all of it) that this worker pushes and pulls (None: a
        # split tensor, its local part is the piece: FSDP's chunk d of TP rank t's part).
        dims, self.rows = None, [None] * len(self.locals)
        if self.tp > 1:
            dims = [tp_split_dim(p) for p in trainer.params]
            self.rows = [
                None if dim is not None else chunk_rows(part.shape[0] if part.dim() else 1, self.tp, self.tp_rank)
                for dim, part in zip(dims, self.locals, strict=True)
            ]
        self.layout = ShardLayout([tuple(p.shape) for p in trainer.params], self.shards, dims, self.tp)
        sizes = [t.numel() for t in self._pieces(self.locals)]
        if sizes != self.layout.chunk_sizes(self.piece):  # FSDP or the plan cut otherwise than the shards assume
            raise RuntimeError(
                f"worker {self.ctx.rank}: its local pieces hold {sizes} values, the PS shard "
                f"{self.piece} layout {self.layout.chunk_sizes(self.piece)}"
            )
        n = sum(sizes)
        lo, hi = self.ctx.ps_bounds[self.piece]
        if hi - lo != n:
            raise RuntimeError(f"PS shard {self.piece} holds {hi - lo} values, worker {self.ctx.rank} {n}")
        timeout = self.config.hang_timeout_s * PS_WAIT_FACTOR + PS_WAIT_MARGIN_S
        shard = self.ctx.ps_shards[self.piece]
        self.client = PSClient([shard], [(0, n)], self.replica, timeout, self.channel.link)
        self.theta = torch.empty(n, dtype=torch.float32)  # θ piece d (or t) on the host, as the shard serves it
        self.ps_bytes = n * self.theta.element_size()
        self.clock = self.client.pull(self.theta.numpy())
        if self.k_of_n and not self.config.elastic:  # the round the shards are at (a replica dropped before a
            self._agree_round(self.client.read_versions[0])  # restore point may be ahead; a range: `_enter_rounds`)
        self._install()

    @contextmanager
    def _inside_replica(self) -> Iterator[None]:
        """The replica's own collectives (FSDP's, the votes over its D workers). Under a range, one that
        fails because a worker of the replica is gone (gloo on a closed connection, the group's timeout)
        raises `GroupBroken`: the worker's segment returns what it did and the driver takes the replica
        out as for the lost worker (orchestrator/controller/scaling.py `broken_replica`), never as the
        user's code raising."""
        try:
            yield
        except (RuntimeError, OSError) as e:
            if self.config.elastic and peer_lost(e):
                raise GroupBroken(str(e)) from e
            raise

    def compute_gradients(self, trainer: ShardedTrainer, batch: Any) -> float:  # type: ignore[override]
        with self._inside_replica():  # FSDP's all-gathers and reduce-scatter inside the replica
            return trainer.compute_gradients(batch)

    def _pieces(self, tensors: list[Any]) -> list[Any]:
        """This worker's pieces of `tensors` (its local parts, or gradients alike): a split tensor's local
        part whole, a tensor the plan leaves whole (tensor parallelism) cut to this worker's rows of dim 0."""
        pieces = []
        for t, rows in zip(tensors, self.rows, strict=True):
            if rows is not None:
                t = (t if t.dim() else t.view(1))[rows[0] : rows[1]]
            pieces.append(t)
        return pieces

    def _install(self) -> None:
        """θ piece d x T + t, as pulled into `self.theta`, into this worker's local parameter parts. Under
        --tensor-parallel a tensor held whole gets this worker's rows from its shard and the other rows
        from the T - 1 others (their rows, zeros elsewhere, summed over the T workers of its data-parallel
        rank: exact, one nonzero per value), so the T workers hold it alike, whatever moment each pulled at."""
        import torch
        import torch.distributed as dist

        offset = 0
        whole = [part for part, rows in zip(self.locals, self.rows, strict=True) if rows is not None]
        with torch.no_grad():
            for part in whole:
                part.zero_()
            for piece in self._pieces(self.locals):
                piece.copy_(self.theta[offset : offset + piece.numel()].view_as(piece))
                offset += piece.numel()
            if whole:
                flat = torch.cat([part.reshape(-1) for part in whole])
                with self._inside_replica():
                    dist.all_reduce(flat, group=self.tp_group)
                for part, values in zip(whole, flat.split([part.numel() for part in whole]), strict=True):
                    part.copy_(values.view_as(part))

    def _local_gradient(self, trainer: ShardedTrainer) -> Any:
        """This worker's gradient pieces (the replica's mean over its D x B samples, or T x B under a hybrid
        plan), flat, on the host: under --tensor-parallel a tensor held whole (its gradient, or FSDP's chunk
        d of it, the same on the T workers) is pushed once per replica, each worker its own rows."""
        import torch

        from distrain.trainers.sharded_trainer import local_part

        grads = [
            torch.zeros_like(part) if p.grad is None else local_part(p.grad)
            for p, part in zip(trainer.params, self.locals, strict=True)
        ]
        parts = [g.detach().reshape(-1) for g in self._pieces(grads)]
        return torch.cat(parts).float().cpu() if parts else torch.zeros(0)

    def step(self, trainer: ShardedTrainer, lr: float) -> CommStats:  # type: ignore[override]
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        trainer.unscale_grads_()  # --precision fp16: the replica's gradient, divided by the loss scale
        with self._inside_replica():
            trainer.clip_gradient_(self.update_group)  # --clip-grad-norm: the replica's gradient, each push
        grads = self._local_gradient(trainer)
        ok = bool(grads.sum().isfinite()) and math.isfinite(trainer.last_loss)
        if self.config.on_nonfinite == "skip" or trainer.scaler is not None:
            # The replica's D workers skip together (one update); under fp16 an overflow's inf may sit in
            # some of its chunks only, and its workers halve their scales alike. Replicas decide apart, as
            # plain workers under the PS do (each its own scale): a run-wide vote would be a barrier the
            # asynchronous strategies exist to avoid.
            flag = torch.tensor([0.0 if ok else 1.0])
            with self._inside_replica():
                dist.all_reduce(flag, group=self.update_group)
            ok = float(flag) == 0.0
        ok = self.gradient_decision(trainer.scaler, ok, "loss or gradient")
        # Through the channel: under --compress this worker's chunk goes through the codec with its own
        # residual (one bound: the chunk), and the shard decodes it (ps_shard.decoded).
        pushed = grads if ok else None
        result, traffic = self.channel.push_pull("grads", self.clock, pushed, lr, self.theta.numpy(), self.client)
        if self.k_of_n:  # rounds that closed without this replica are skipped, with their data
            before = self.clock
            self._agree_round(result.version)
            if not self.config.elastic:  # (a range: units are shared, each computed once; none is skipped)
                self.skip += self.clock - (before + 1)
        else:
            self.clock = result.version if self.rounds else self.clock + 1
        self._install()
        extra = self.layout_columns(trainer)
        return CommStats(
            seconds=time.perf_counter() - t0 - traffic.seconds,  # (the push-pull's are added below)
            bytes_sent=self.traffic,  # FSDP's inside the replica, then the push and pull (`traffic`)
            bytes_received=self.traffic,
            wait_s=result.wait_s,
            read_version=result.read_version,
            applied_version=result.applied_version,
            lag=result.lag,
            clock=result.clock,
            min_clock=result.min_clock,
            dropped=result.dropped if self.rounds else None,
            nonfinite=None if ok else True,
            extra=extra,
        ).add(traffic)

    def _agree_round(self, version: int) -> None:
        """k-of-n: the replica's D workers go on at one round, the most advanced of their shards' versions
        (each worker's shard answered at its own moment, so one may already be a round further), and
        pull θ chunk d at it; the clock is that round. A shard may have moved on again by then: the
        gradient computed on that θ then comes late at every shard (its round is decided) and is dropped,
        so no counted gradient is ever computed on chunks of different versions."""
        import torch
        import torch.distributed as dist

        agreed = torch.tensor([version], dtype=torch.int64)
        with self._inside_replica():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.update_group)
        target = int(agreed)
        if version < target:
            self.client.pull_at(target, self.theta.numpy())
        self.clock = target

    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        """The units of rounds that closed without this replica (k-of-n) are skipped, by its D workers alike.
        Elastic: the units as dealt (the driver gives worker d slice s x D + d of a replica unit s), and
        under BSP the replica enters the rounds where the driver put it (`_enter_rounds`)."""
        if self.config.elastic:
            if self.rounds and units:
                self._enter_rounds()
            yield from units
            return
        for unit in super().plan(units):
            if self.skip > 0:
                self.skip -= 1
                continue
            yield unit

    def _enter_rounds(self) -> None:
        """Elastic BSP, at a segment's start: the round this replica pushes for next, as plain elastic BSP
        over the PS finds it (strategies/bsp.py `BSPOverPS.plan`): the round the driver entered it at
        (its clock on the shards), or that of the θ it holds if newer (an evaluation pulled it). Its D
        workers take the furthest of their answers (each asked its own shard, at its own moment) and pull
        θ chunk d at it, so the replica's gradient is computed on chunks of one version."""
        import ray
        import torch
        import torch.distributed as dist

        entry = ray.get(self.client.shards[0].clock_of.remote(self.replica), timeout=self.client.timeout_s)
        mine = max(entry, self.clock, self.client.read_versions[0])
        agreed = torch.tensor([mine], dtype=torch.int64)
        with self._inside_replica():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.update_group)
        target = int(agreed)
        if target != self.client.read_versions[0]:
            self.client.pull_at(target, self.theta.numpy())
            self._install()
        self.clock = target

    def prepare_eval(self, trainer: ShardedTrainer) -> None:  # type: ignore[override]
        self.client.pull(self.theta.numpy())
        self._install()

    # ------------------------------------------------------------------ state
    def checkpoint_shards(self, trainer: ShardedTrainer, step: int, directory: Any) -> None:  # type: ignore[override]
        """None: the shards hold the state, and the driver writes it whole from `export_state`."""
        return None

    def export_state(self, trainer: ShardedTrainer) -> dict[str, Any]:  # type: ignore[override]
        """Every PS shard's snapshot, un-permuted into the whole model's order: θ as a whole model state
        dict, the optimizer state as whole flat vectors, and the shards' counters."""
        import numpy as np
        import ray
        import torch

        from distrain.strategies.ps_client import counters_of
        from distrain.trainers.optim_state import FlatOptimizerState

        snaps = ray.get([s.snapshot.remote() for s in self.ctx.ps_shards], timeout=self.client.timeout_s)
        theta = self.layout.from_shards(torch.from_numpy(np.concatenate([s["theta"] for s in snaps])))
        optimizer = FlatOptimizerState.concat([FlatOptimizerState.from_dict(s["optimizer"]) for s in snaps])
        optimizer.vectors = {k: self.layout.from_shards(v) for k, v in optimizer.vectors.items()}
        model = whole_state_dict(trainer, theta)
        return {"model": model, "optimizer": optimizer.to_dict(), "ps": counters_of(snaps[0])}


class ShardedAsync(ShardedPS):
    name = "async"

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        return ConsistencyRule.asynchronous(config.options_of("async").staleness_lr)


class ShardedSSP(ShardedPS):
    name = "ssp"

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        options = config.options_of("ssp")
        return ConsistencyRule.ssp(options.staleness, options.staleness_lr)


class ShardedBSPOverPS(ShardedPS):
    name = "bsp"

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        """Rounds of the R replicas' chunks; with --backup-workers K, of the first R of R + K replicas whose
        every chunk has arrived, agreed by all D shards; under --workers MIN..MAX, of the member replicas'
        (plain elastic BSP's rule over MAX replica slots: with K, of the first members - K complete), agreed
        by the shards too (the referee decides from shard 0's members)."""
        shards, tp, _ = config.replica_grid  # a replica pushes D pieces, or T, or D x T
        backups = config.options_of("bsp").backup_workers
        if config.elastic:
            return ConsistencyRule.elastic_bsp(backups, config.lr_scaling, config.worker_slots, parts=shards * tp)
        if backups:
            return ConsistencyRule.bsp(accept=config.workers, parts=shards * tp)
        return ConsistencyRule.bsp()
