"""Local SGD / periodic averaging (PASGD), with AdaComm's adaptive τ: `--strategy local-sgd`.

Each worker takes τ local optimizer steps on its own slice of every global batch, then all workers
average their parameters with one all-reduce over the collective transport (one communication
round; `--comm-delay-ms` adds its delay once per round). τ = 1 with plain SGD is BSP.

Parameters travel as their change since the last round (every replica starts a period from the same
θ), which is the same average with much less float32 rounding.

Optimizer state at an averaging round: the optimizer's per-parameter state vectors (SGD momentum
buffers, Adagrad sums, Adam moments) are averaged together with the parameters, in the same
all-reduce. Every replica therefore leaves a round with the same parameters *and* the same optimizer
state, so a replica is one well-defined model state at every round (what a checkpoint, an evaluation
or a switch to another strategy reads), and τ = 1 equals BSP with momentum too. Scalar state (Adam's
step count) is equal on every worker already. The price is that a round moves (1 + k) · n values for
k state vectors instead of n.

Periods are cut at epoch ends: a round also happens after a worker's last step of an epoch (or of
the run, or before a step checkpoint of --checkpoint-steps) if any local step is pending, and the next
period starts afresh. So every evaluation, checkpoint and strategy switch sees the one averaged model.
The step rows record the τ in force and the number of rounds completed.

Adaptive τ (`--adaptive-tau`, see `adacomm.py`): each round's all-reduce carries, beside θ and the
optimizer state, each worker's [loss sum, loss count, seconds since the interval began]; summed,
they give the worker-averaged loss of the period and the workers' mean interval time. Every worker
feeds these identical numbers to the same rule, so all agree on τ without a further message.

`--compress CODEC`: θ's change goes through the codec (its own all-reduce, error feedback kept per
worker); the optimizer state and the statistics follow in a second, float32 all-reduce, since a lossy
code of the state or of AdaComm's inputs would make the replicas disagree on what they hold or on τ.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError
from distrain.fields import setting
from distrain.strategies.adacomm import TauInterval
from distrain.strategies.base import (
    CommStats,
    PlanningSetting,
    Strategy,
    StrategyContext,
    StrategyOptions,
    all_finite,
)
from distrain.strategies.elastic_group import GroupBroken, ReformedGroup, book_round, lr_factor
from distrain.strategies.local_periods import LocalPeriods
from distrain.strategies.strategy_names import STRATEGIES
from distrain.trainers.shares import ShareTally, block_weight

if TYPE_CHECKING:
    import torch

    from distrain.config import RunConfig
    from distrain.trainers.local_trainer import LocalTrainer

DEFAULT_TAU = 8
# AdaComm defaults: re-choose τ ten times a run whatever its length (a wall-clock interval can outlast a
# short run), and let τ rise to twice τ_0 (the rule's ratio exceeds 1 when the loss rises or the rate decays).
DEFAULT_TAU_INTERVAL = "10%"
DEFAULT_TAU_MAX_FACTOR = 2


@dataclass(frozen=True)
class LocalSGDOptions(StrategyOptions):
    tau: int | None = setting(
        None, "Local steps between parameter averages (adaptive: tau_0); default 8 (local-sgd).", "strategy"
    )
    adaptive_tau: bool = setting(
        False, "Re-choose tau every --tau-interval from the loss (AdaComm; local-sgd).", "strategy"
    )
    tau_interval: str | None = setting(
        None,
        "AdaComm interval: seconds like 5s, local steps like 200, or a share of the run's steps like 10%; "
        "default 10% (local-sgd --adaptive-tau).",
        "strategy",
    )
    tau_max: int | None = setting(
        None, "AdaComm: largest tau it may choose; default 2 x --tau (local-sgd --adaptive-tau).", "strategy"
    )

    def resolved(self, run: RunConfig) -> LocalSGDOptions:
        tau = DEFAULT_TAU if self.tau is None else self.tau
        if not self.adaptive_tau:
            return dataclasses.replace(self, tau=tau)
        return dataclasses.replace(
            self,
            tau=tau,
            tau_interval=DEFAULT_TAU_INTERVAL if self.tau_interval is None else self.tau_interval,
            tau_max=DEFAULT_TAU_MAX_FACTOR * tau if self.tau_max is None else self.tau_max,
        )

    def check(self, run: RunConfig) -> None:
        assert self.tau is not None
        if self.tau < 1:
            raise ConfigError(f"--tau must be >= 1, got {self.tau}")
        if self.tau_max is not None and self.tau_max < self.tau:
            raise ConfigError(f"--tau-max ({self.tau_max}) is below --tau ({self.tau}); raise it or drop it")
        if not self.adaptive_tau:
            for name in ("tau_interval", "tau_max"):
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise ConfigError(f"{flag} only applies with --adaptive-tau; add --adaptive-tau or drop {flag}")
            return
        assert self.tau_interval is not None
        TauInterval.parse(self.tau_interval)
        if run.elastic:  # its statistics are means over a fixed group; a range changes the group
            raise ConfigError(
                "--adaptive-tau does not compose with --workers MIN..MAX; use a fixed --workers N or drop it"
            )


STATS = 3  # loss sum, loss count, interval seconds: appended to the averaged buffer


@STRATEGIES.register("local-sgd", "local SGD: tau local steps, then average parameters (--adaptive-tau: AdaComm)")
class LocalSGD(LocalPeriods, Strategy):
    name = "local-sgd"
    streams_data = True  # over the collective, one replica a worker (orchestrator/streaming.py)
    transports = ("collective",)
    Options = LocalSGDOptions
    compresses = "theta's change at a round (optimizer state and AdaComm's statistics travel in float32)"
    elastic_transports = ("collective",)  # --workers MIN..MAX: ElasticLocalSGD (below)
    described_options = ("tau", "adaptive_tau", "tau_interval", "tau_max")
    planning = (PlanningSetting("tau", "period", DEFAULT_TAU),)

    @classmethod
    def settings_text(cls, config: dict[str, Any]) -> str:
        if config.get("tau") is None:
            return ""
        text = f" tau={config['tau']}"
        if config.get("adaptive_tau"):
            text += f" adaptive ({config.get('tau_interval')}, max {config.get('tau_max')})"
        return text

    @classmethod
    def implementation(cls, config: RunConfig) -> type[Strategy]:
        if config.sharded and config.elastic:  # --workers MIN..MAX: whole replicas join and leave at averages
            from distrain.strategies.elastic_cut import ElasticShardedLocalSGD

            return ElasticShardedLocalSGD
        if config.sharded:  # replicas cut over workers (--fsdp, --tensor-parallel): rounds part by part
            from distrain.strategies.sharded_local_sgd import ShardedLocalSGD

            return ShardedLocalSGD
        if config.elastic:  # re-formed at averaging boundaries (orchestrator/controller/collective_scaling.py)
            return ElasticLocalSGD
        return cls

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.init_periods(config, self.options, ctx.total_steps)
        self.anchor: torch.Tensor | None = None  # θ after the last round (equal on every worker)
        self.tally = ShareTally()  # heterogeneous shares: the samples this replica took since the last round

    def setup(self, trainer: LocalTrainer) -> None:
        self.channel.join()
        # Replicas start equal (same seed, or the same loaded state); the broadcast makes it a fact.
        self.channel.broadcast(trainer.params_flat, src=0)
        self.anchor = trainer.params_flat.clone()
        self.channel.open("params", shapes=[p.shape for p in trainer.params])  # θ's change (a codec's shapes)
        self.interval_start = time.perf_counter()

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        # A local step is this worker's own: decided on its own loss and gradient (skipped: no update).
        ok = self.usable_gradient(trainer, "loss or gradient", check_loss=True)
        if ok:
            trainer.apply_update(lr)
        return self.book_step(trainer, lr, ok)

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """Unequal shares: each replica takes its τ local steps at its own batch, and the round weighs it by
        the samples it trained on (`ShareTally`); τ = 1 is then BSP at the global batch, momentum included."""
        self.tally.add(samples, step_samples)

    def at_epoch_end(self, trainer: LocalTrainer) -> CommStats | None:
        if self.pending == 0:
            return None
        stats = self.average(trainer)
        stats.averaging_round = self.rounds
        return stats

    def average(self, trainer: LocalTrainer) -> CommStats:
        """One averaging round: θ, the optimizer's state vectors and the AdaComm statistics, in one all-reduce."""
        import torch

        assert self.anchor is not None, "setup() must run before step()"
        opt = trainer.flat_optimizer_state()
        n = trainer.numel
        stats = torch.tensor(self.period_statistics(), dtype=trainer.params_flat.dtype)
        vectors = [v.to(trainer.params_flat.device) for v in opt.vectors.values()]
        # θ travels as its change since the last round: mean(θ_i) = θ_anchor + mean(θ_i - θ_anchor) exactly,
        # but small deltas average with far less float32 rounding than whole parameters do. The optimizer
        # state and the statistics stay float32 under --compress (a lossy code of them would make the
        # replicas disagree on what they hold or on τ): the channel sends them after θ's change.
        buffer = torch.cat([trainer.params_flat - self.anchor, *vectors, stats.to(trainer.params_flat.device)])
        weight = self.tally.take(self.ctx.world_size)
        if weight != 1.0:  # θ's change and the optimizer state, not the statistics
            buffer[: n * (1 + len(vectors))].mul_(weight)
        traffic = self.channel.all_reduce("params", buffer, exact_tail=buffer.numel() - n)
        # Every worker holds the same averaged buffer, so all agree. Skipped, the round is discarded:
        # each replica goes back to the last average (its local optimizer state stays as it is).
        finite = self.finite(all_finite(buffer), "averaged parameters")
        if finite:
            self.anchor.add_(buffer[:n])
        trainer.params_flat.copy_(self.anchor)
        if vectors and finite:
            for i, key in enumerate(opt.vectors):
                opt.vectors[key] = buffer[(i + 1) * n : (i + 2) * n].cpu()
            trainer.load_flat_optimizer_state(opt)
        # Means over workers (the all-reduce divided by N): loss sum / loss count is the mean loss.
        loss_sum, loss_count, mean_elapsed = (float(v) for v in buffer[-STATS:].cpu())
        self.round_closed(loss_sum, loss_count, mean_elapsed)
        return CommStats(nonfinite=None if finite else True).add(traffic)


class ElasticLocalSGD(ReformedGroup, LocalSGD):
    """Local SGD over the collective transport under --workers MIN..MAX: the driver deals blocks of τ
    rounds (`block_rounds`), each member takes a local step on each of its units, and the block ends in
    the averaging round (`settle`), so a block boundary is an averaging boundary: every member holds
    the one averaged model there, and that is where the group is re-formed. A local step's rate follows
    the global batch of the members, as BSP's does (`lr_factor` of the group's size); the average is
    over the members that took a step in the block (one with only placeholders adds nothing). If the
    averaging all-reduce fails (a peer lost), the block is undone: the replica goes back to the last
    average (parameters and optimizer state) and its rows are dropped; its units are redone."""

    elastic = True
    metric_columns = {"members": "int32"}

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        tau = config.options_of("local-sgd").tau
        assert tau is not None
        return tau

    @property
    def slices_per_step(self) -> int:
        return self.config.worker_slots

    def setup(self, trainer: LocalTrainer) -> None:
        """No group yet (`reform`); the last average is the start."""
        self.trainer = trainer
        self.reformed(trainer)
        self.took = 0  # local steps taken in this block

    def reformed(self, trainer: LocalTrainer) -> None:
        """After a re-form's broadcast: every member's last average is the state it was given."""
        self.anchor = trainer.params_flat.clone()
        self.anchor_optimizer = trainer.flat_optimizer_state()
        self.pending, self.took = 0, 0
        self.tally = ShareTally()  # (a block undone or re-formed counts afresh)

    def sit_out(self, trainer: LocalTrainer) -> None:
        """No unit for this member in this round: no local step at all (its optimizer state stays)."""
        self.sitting = True

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        assert self.channel.joined, "reform() must run before step()"
        size = self.channel.world_size
        if getattr(self, "sitting", False):
            self.sitting = False
            return CommStats(period=self.tau, averaging_round=self.rounds, extra={"members": size})
        c = self.config
        # --balance speed: every round is a whole step of MAX x --batch-size cut among the members, so the
        # rate is the configured one, as at a fixed size with shares.
        scale = (
            1.0
            if c.balance == "speed"
            else lr_factor(size, c.worker_slots, c.batch_size, c.base_batch_size, c.lr_scaling)
        )
        rate = lr * scale
        ok = self.usable_gradient(trainer, "loss or gradient", check_loss=True)
        if ok:
            trainer.apply_update(rate)
            self.took += 1
        return CommStats(
            period=self.tau,
            averaging_round=self.rounds,
            nonfinite=None if ok else True,
            lr=rate,
            extra={"members": size},
        )

    def at_epoch_end(self, trainer: LocalTrainer) -> CommStats | None:
        return None  # blocks never cross an epoch: `settle` averages at its end already

    def settle(self, rows: dict[str, list]) -> None:
        """The block's averaging round: Σ w·(θ_i − θ_anchor), Σ w·state_i, Σ w in one all-reduce, w = 1 for
        a member that took a step (`block_weight`: under --balance speed its samples in the block). Raises
        GroupBroken (after going back to the last average) if it fails."""
        import torch

        assert self.channel.joined
        trainer = self.trainer
        n = trainer.numel
        opt = trainer.flat_optimizer_state()
        w = block_weight(self.config.balance == "speed", self.tally, self.took)
        parts = [(trainer.params_flat - self.anchor) * w]
        parts += [v.to(trainer.params_flat.device) * w for v in opt.vectors.values()]
        parts.append(torch.tensor([w], dtype=trainer.params_flat.dtype, device=trainer.params_flat.device))
        buffer = torch.cat(parts)
        try:
            traffic = self.channel.all_reduce("params", buffer, op="sum")
        except (RuntimeError, OSError) as e:
            trainer.params_flat.copy_(self.anchor)  # the block is undone: back to the last average
            trainer.load_flat_optimizer_state(self.anchor_optimizer)
            self.took, self.tally = 0, ShareTally()
            raise GroupBroken(str(e)) from e
        members = float(buffer[-1])
        if members > 0:
            buffer.div_(members)
            self.anchor.add_(buffer[:n])
            for i, key in enumerate(opt.vectors):
                opt.vectors[key] = buffer[(i + 1) * n : (i + 2) * n].cpu()
        trainer.params_flat.copy_(self.anchor)
        trainer.load_flat_optimizer_state(opt)
        self.anchor_optimizer = opt
        self.rounds += 1
        self.pending, self.took = 0, 0
        self.tally = ShareTally()
        book_round(rows, traffic, self.rounds)  # the round's time and bytes go on the block's last row
