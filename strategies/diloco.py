"""DiLoCo, distributed low-communication training (Douillard et al. 2023): `--strategy diloco`.

Every replica keeps the last synchronised parameters θ_g. It takes H = `--sync-every` inner steps with
the run's optimizer (`--optimizer`, `--lr`, ...: the *inner* optimizer, whose state stays on the
replica and is never averaged) from θ_g to θ_i. Then one all-reduce averages the pseudo-gradients
Δ_i = θ_g − θ_i, and an *outer* optimizer takes one step on θ_g with gradient Δ = mean Δ_i
(`--outer-optimizer`, default SGD with Nesterov momentum, `--outer-lr 0.7`, `--outer-momentum 0.9`,
the paper's). Every replica then continues from the new θ_g. A round moves n values, as local SGD's
θ-only average would; the outer optimizer runs on every replica on identical inputs, so its state
(the Nesterov momentum) is identical everywhere and never travels.

Identities (tests/integration/test_diloco.py): with outer SGD at lr 1 and no momentum, θ_g becomes the plain mean
of the θ_i (parameter averaging after H steps); with H = 1, inner plain SGD and that outer optimizer,
DiLoCo is BSP.

Periods are cut where the replica must be one well-defined model: after a worker's last step of an
epoch (or of the run), and before a step checkpoint (`--checkpoint-steps`). There an outer step
closes the period early, so evaluations, checkpoints and strategy switches all read θ_g (equal on
every replica). A checkpoint holds θ_g (the model), the outer optimizer's state and the outer step
count (`extra_state`), and worker 0's inner optimizer state (the run's optimizer state, as for every
strategy). Resuming is therefore exact for the parameters and the outer optimizer, and for the inner
optimizer when it is stateless (SGD without momentum); a stateful inner optimizer (momentum, Adam's
moments) restarts every replica from worker 0's inner state, which is what a schedule hands to
DiLoCo too (the previous phase's optimizer state becomes every replica's inner state; the outer
optimizer starts afresh at a switch).

Streaming DiLoCo (Douillard et al. 2025): `--fragments P` cuts θ into P groups of whole tensors of
about equal size (`fragment_spans`), each with its own θ_g copy and outer optimizer; fragment p
synchronises at the inner steps t with t mod H = p·H/P, so one fragment at a time is on the wire.
Its all-reduce starts in the background; `--overlap-steps τ` inner steps later it is waited for, its
outer step taken and the result mixed in: θ_i ← α·θ_i + (1 − α)·θ_g (`--mix-alpha`, 0: take θ_g). A
closed period (epoch end, step checkpoint, switch) lets every fragment in flight arrive and syncs every
fragment changed since its last sync, with α = 0. One fragment, τ = 0, α = 0 is DiLoCo itself, the
same code path; outer_steps counts fragment outer steps. Each fragment's all-reduce is one transfer
on the emulated link (`--comm-bandwidth`), so its overlap with the inner steps is modelled.

The fragments and their rounds are strategies/fragments.py's (`Fragment`, `FragmentRounds`), shared
with DiLoCo across cut replicas (`--fsdp`, `--tensor-parallel`: strategies/sharded_diloco.py), where each
worker synchronises its part of a fragment's tensors with the workers holding that part in the other
replicas.

`--compress CODEC` compresses the pseudo-gradients, each fragment a stream of its own (error feedback,
PowerSGD's warm start). A compressed all-reduce is blocking: it runs when the fragment is launched, and
with --overlap-steps its mean still waits τ inner steps before it is mixed in (the same values as
uncompressed streaming, without the overlap in time).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError
from distrain.fields import setting
from distrain.strategies.adacomm import outer_steps_figure
from distrain.strategies.base import (
    CommStats,
    PlanningSetting,
    Strategy,
    StrategyContext,
    StrategyOptions,
    all_finite,
)
from distrain.strategies.elastic_group import GroupBroken, ReformedGroup, book_round, lr_factor
from distrain.strategies.fragments import Fragment, FragmentRounds, fragment_plan, fragment_stream
from distrain.strategies.strategy_names import STRATEGIES
from distrain.trainers.shares import ShareTally, block_weight

if TYPE_CHECKING:
    import torch

    from distrain.config import RunConfig
    from distrain.trainers.local_trainer import LocalTrainer

DEFAULT_SYNC_EVERY = 8
DEFAULT_OUTER_MOMENTUM = 0.9


@dataclass(frozen=True)
class DiLoCoOptions(StrategyOptions):
    sync_every: int = setting(
        DEFAULT_SYNC_EVERY, "Inner steps H between outer steps, the pseudo-gradient all-reduces (diloco).", "strategy"
    )
    outer_optimizer: str = setting(
        "sgd",
        "Outer optimizer on the averaged pseudo-gradient, an element-wise torch.optim name; "
        "sgd runs with Nesterov momentum (diloco).",
        "strategy",
    )
    outer_lr: float = setting(0.7, "Outer optimizer's learning rate (diloco).", "strategy")
    outer_momentum: float | None = setting(
        None,
        "Outer optimizer's Nesterov momentum; default 0.9, 0 turns it off (diloco --outer-optimizer sgd).",
        "strategy",
    )

    fragments: int = setting(
        1,
        "Streaming DiLoCo: cut the parameters into P fragments of whole tensors, synchronised in turn, "
        "fragment p at the inner steps t with t mod H = p*H/P (diloco).",
        "strategy",
    )
    overlap_steps: int = setting(
        0,
        "Streaming DiLoCo: inner steps a fragment's all-reduce runs in the background before it is mixed "
        "in, below --sync-every (diloco).",
        "strategy",
    )
    mix_alpha: float = setting(
        0.0,
        "Streaming DiLoCo: a fragment arriving is mixed in as alpha*local + (1-alpha)*global; 0 takes the "
        "global value (diloco).",
        "strategy",
    )

    def resolved(self, run: RunConfig) -> DiLoCoOptions:
        if self.outer_optimizer == "sgd" and self.outer_momentum is None:
            return dataclasses.replace(self, outer_momentum=DEFAULT_OUTER_MOMENTUM)
        return self

    def check(self, run: RunConfig) -> None:
        from distrain.trainers.optim_state import OPTIMIZERS

        if self.sync_every < 1:
            raise ConfigError(f"--sync-every must be >= 1, got {self.sync_every}")
        if not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise ConfigError(f"--outer-lr must be a positive number, got {self.outer_lr}")
        if self.outer_optimizer not in OPTIMIZERS:
            valid = ", ".join(OPTIMIZERS)
            raise ConfigError(f"unknown --outer-optimizer {self.outer_optimizer!r}; choose one of: {valid}")
        if self.fragments < 1:
            raise ConfigError(f"--fragments must be >= 1, got {self.fragments}")
        if self.fragments > self.sync_every:
            raise ConfigError(
                f"--fragments ({self.fragments}) exceeds --sync-every ({self.sync_every}): each fragment needs "
                "its own inner step of the period; lower --fragments or raise --sync-every"
            )
        if not 0 <= self.overlap_steps < self.sync_every:
            raise ConfigError(
                f"--overlap-steps must be in [0, --sync-every) = [0, {self.sync_every}), got {self.overlap_steps}"
            )
        if not 0 <= self.mix_alpha <= 1:
            raise ConfigError(f"--mix-alpha must be in [0, 1], got {self.mix_alpha}")
        if self.outer_optimizer != "sgd" and self.outer_momentum is not None:
            raise ConfigError(f"--outer-momentum applies to --outer-optimizer sgd, not {self.outer_optimizer}; drop it")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if run.elastic and (self.fragments > 1 or self.overlap_steps > 0):
            # Fragments synchronise inside a block; a change of members could only wait for all to land.
            flag = "--fragments" if self.fragments > 1 else "--overlap-steps"
            raise ConfigError(
                f"{flag} (Streaming DiLoCo) does not compose with --workers MIN..MAX; use a fixed --workers N "
                f"or drop {flag}"
            )

    def make_outer_optimizer(self, params: torch.nn.Parameter | list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The outer optimizer over θ_g: one flat parameter (a fragment), or a cut replica's parts."""
        from distrain.trainers.optim_state import make_optimizer

        params = params if isinstance(params, list) else [params]
        if self.outer_optimizer == "sgd":
            momentum = self.outer_momentum or 0.0
            return make_optimizer("sgd", params, self.outer_lr, momentum, None, {"nesterov": momentum > 0})
        return make_optimizer(self.outer_optimizer, params, self.outer_lr)


@STRATEGIES.register("diloco", "DiLoCo: H inner steps, then an outer optimizer step on the averaged pseudo-gradient")
class DiLoCo(FragmentRounds, Strategy):
    name = "diloco"
    streams_data = True  # over the collective, one replica a worker (orchestrator/streaming.py)
    transports = ("collective",)
    Options = DiLoCoOptions
    compresses = "the pseudo-gradients, fragment by fragment (blocking: a compressed fragment does not overlap)"
    # The inner rate: at the run's 0.05 (SGD, momentum 0.9) the outer Nesterov step overshoots on the
    # default task (test accuracy 0.95 at 4.5 s, then oscillating down to 0.90 by epoch 12); 0.01 ends at 0.99.
    run_defaults = {"lr": 0.01}
    elastic_transports = ("collective",)  # --workers MIN..MAX: ElasticDiLoCo (below)
    described_options = ("sync_every", "outer_optimizer", "outer_lr", "outer_momentum", "fragments", "overlap_steps",
                         "mix_alpha")  # fmt: skip
    planning = (PlanningSetting("sync_every", "period", DEFAULT_SYNC_EVERY),)

    @classmethod
    def settings_text(cls, config: dict[str, Any]) -> str:
        c = config
        if c.get("sync_every") is None:
            return ""
        outer = c.get("outer_optimizer") or "sgd"
        momentum = f" nesterov {c['outer_momentum']:g}" if outer == "sgd" and c.get("outer_momentum") else ""
        text = f" H={c['sync_every']} outer {outer} lr {c.get('outer_lr'):g}{momentum}"
        if (c.get("fragments") or 1) > 1:
            text += f" fragments={c['fragments']} overlap={c.get('overlap_steps', 0)} alpha={c.get('mix_alpha', 0):g}"
        return text

    @classmethod
    def implementation(cls, config: RunConfig) -> type[Strategy]:
        if config.sharded and config.elastic:  # --workers MIN..MAX: whole replicas join and leave at outer steps
            from distrain.strategies.elastic_cut import ElasticShardedDiLoCo

            return ElasticShardedDiLoCo
        if config.sharded:  # replicas cut over workers (--fsdp, --tensor-parallel): outer steps part by part
            from distrain.strategies.sharded_diloco import ShardedDiLoCo

            return ShardedDiLoCo
        if config.elastic:  # re-formed at outer-step boundaries (orchestrator/controller/collective_scaling.py)
            return ElasticDiLoCo
        return cls

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.start_rounds()

    @classmethod
    def check_model(cls, config: RunConfig, tensor_sizes: list[int]) -> None:
        fragments = config.options_of(cls.name).fragments
        if fragments > len(tensor_sizes):
            raise ConfigError(
                f"--fragments {fragments} exceeds the model's {len(tensor_sizes)} parameter tensors "
                "(a fragment is a group of whole tensors)"
            )

    def setup(self, trainer: LocalTrainer) -> None:
        self.channel.join()
        self.channel.broadcast(trainer.params_flat, src=0)  # replicas start from one θ_g
        o: DiLoCoOptions = self.options
        sizes = [p.numel() for p in trainer.params]
        self.fragments = [
            Fragment.create(lo, hi, offset, tensors, trainer.params_flat, o)
            for lo, hi, offset, tensors in fragment_plan(sizes, o.fragments, o.sync_every)
        ]
        self.tallies = [ShareTally() for _ in self.fragments]
        # Each fragment's pseudo-gradient is a stream of its own (under --compress: its own error feedback
        # and PowerSGD warm start, which needs the fragment's tensor shapes).
        for p, f in enumerate(self.fragments):
            f.stream = fragment_stream(p, len(self.fragments))
            self.channel.open(f.stream, shapes=[trainer.params[i].shape for i in f.tensors])

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        # An inner step is the replica's own: decided on its own loss and gradient (skipped: no update).
        ok = self.usable_gradient(trainer, "loss or gradient", check_loss=True)
        if ok:
            trainer.apply_update(lr)
        stats = self.after_inner_step(trainer, CommStats())
        if not ok:
            stats.nonfinite = True
        return stats

    def at_epoch_end(self, trainer: LocalTrainer) -> CommStats | None:
        return self.close_period(trainer)

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """Unequal shares: H inner steps at each replica's own batch; each fragment's pseudo-gradient is
        weighted by the samples the replica trained on since that fragment last synced (`ShareTally`), as
        Streaming DiLoCo weighs by tokens, so the outer gradient is the sample-weighted mean."""
        for tally in self.tallies:
            tally.add(samples, step_samples)

    # What a plain replica's θ is: one flat buffer; a fragment is its span [lo, hi).
    def pseudo_gradient(self, f: Fragment, trainer: LocalTrainer) -> torch.Tensor:
        return f.param.data - trainer.params_flat[f.lo : f.hi]

    def agreed_finite(self, delta: torch.Tensor) -> bool:
        return all_finite(delta)  # every replica holds the same mean, so all agree

    def outer_step(self, f: Fragment, delta: torch.Tensor) -> None:
        f.param.grad = delta
        f.outer.step()
        f.param.grad = None

    def mix(self, f: Fragment, trainer: LocalTrainer, alpha: float) -> None:
        local = trainer.params_flat[f.lo : f.hi]
        if alpha == 0:
            local.copy_(f.param.data)
        else:
            local.mul_(alpha).add_(f.param.data, alpha=1 - alpha)

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        return outer_steps_figure(steps)

    def extra_state(self) -> dict[str, Any]:
        """The outer optimizers' state (one flat form over all fragments, as for a single one) and the
        outer steps so far: equal on every replica. Read at closed periods, when nothing is in flight."""
        from distrain.trainers.optim_state import FlatOptimizerState, export_flat_state

        parts = [export_flat_state(f.outer, [f.param]) for f in self.fragments]
        state = {"outer_steps": self.outer_steps, "outer_optimizer": FlatOptimizerState.concat(parts).to_dict()}
        return state | self.fragment_scalars()

    def load_extra_state(self, state: dict[str, Any]) -> None:
        from distrain.trainers.optim_state import FlatOptimizerState, import_flat_state

        self.outer_steps = int(state["outer_steps"])
        flat = FlatOptimizerState.from_dict(state["outer_optimizer"])
        for f in self.fragments:
            import_flat_state(f.outer, [f.param], flat.slice(f.lo, f.hi) if flat.vectors else flat)
        self.restore_fragment_scalars(state)


# DiLoCo under `--workers MIN..MAX` (issue 18).
# It runs through the same re-form loop as elastic local SGD (orchestrator/controller/collective_scaling.py):
# the driver deals blocks of H = `--sync-every` rounds, each member takes an inner step on each of its units
# (a placeholder unit: no step, its inner optimizer state stays), and the block ends in the outer round
# (`settle`), so a block boundary is an outer-step boundary: every member holds θ_g there, and that is
# the only place the group re-forms. The outer round all-reduces [Σ w·(θ_g − θ_i), Σ w] with w = 1 for a
# member that took an inner step in the block, so the pseudo-gradient is the mean over the members that
# trained, whatever their number; the outer optimizer then steps θ_g on every member on identical
# inputs, as in the fixed-size run (strategies/diloco.py).
#
# What a joiner gets by broadcast (orchestrator/worker.py `TrainWorker.reform`): θ_g (the parameters),
# a live member's inner optimizer state (as a schedule hands DiLoCo one), and `extra_state`, the outer
# optimizer's state and outer step count, which every member holds identically. Nothing from disk.
#
# A failed outer all-reduce (a peer lost) undoes the block on every survivor: back to θ_g and the inner
# optimizer state of the block's start; the block's rows are dropped and its units redone after the
# re-form. An inner step's rate follows the members' global batch as elastic local SGD's does
# (`lr_factor`). Streaming DiLoCo (`--fragments` > 1, `--overlap-steps`) is refused with a range: its
# fragments synchronise inside a block, so a change of members could only wait for all of them to land.
class ElasticDiLoCo(ReformedGroup, DiLoCo):
    """DiLoCo whose group can change size at outer-step boundaries (see the module docstring)."""

    elastic = True
    metric_columns = {"members": "int32"}  # the group's size when the row's inner step ran

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        return config.options_of("diloco").sync_every

    @property
    def slices_per_step(self) -> int:
        return self.config.worker_slots  # a step is MAX slices whatever the membership

    def setup(self, trainer: LocalTrainer) -> None:
        """No group yet (`reform`); θ_g is the starting model, one fragment (streaming is refused)."""
        self.trainer = trainer
        self.fragments = [
            Fragment.create(0, trainer.numel, 0, range(len(trainer.params)), trainer.params_flat, self.options)
        ]
        self.sitting = False
        self.reformed(trainer)

    def reformed(self, trainer: LocalTrainer) -> None:
        """After a re-form's broadcast (or at set-up): the replica's θ is θ_g, the block starts here."""
        for f in self.fragments:
            f.param.data.copy_(trainer.params_flat[f.lo : f.hi])
        self.block_start_optimizer = trainer.flat_optimizer_state()
        self.took = 0  # inner steps taken in this block
        self.tallies = [ShareTally()]  # --balance speed: the samples taken in this block (`block_weight`)

    def sit_out(self, trainer: LocalTrainer) -> None:
        """No unit for this member in this round: no inner step (its optimizer state stays)."""
        self.sitting = True

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        assert self.channel.joined, "reform() must run before step()"
        size = self.channel.world_size
        stats = CommStats(period=self.options.sync_every, averaging_round=self.outer_steps, extra={"members": size})
        if self.sitting:
            self.sitting = False
            return stats
        c = self.config
        # --balance speed: every round is a whole step of MAX x --batch-size cut among the members: the
        # configured rate, as at a fixed size with shares.
        balanced = c.balance == "speed"
        stats.lr = lr * (
            1.0 if balanced else lr_factor(size, c.worker_slots, c.batch_size, c.base_batch_size, c.lr_scaling)
        )
        if self.usable_gradient(trainer, "loss or gradient", check_loss=True):
            trainer.apply_update(stats.lr)
            self.took += 1
        else:
            stats.nonfinite = True
        return stats

    def at_epoch_end(self, trainer: LocalTrainer) -> CommStats | None:
        return None  # blocks never cross an epoch or a step checkpoint: `settle` closes each

    def settle(self, rows: dict[str, list[Any]]) -> None:
        """The block's outer round: Σ w·(θ_g − θ_i) and Σ w in one all-reduce, the outer optimizer's step
        on their quotient, every member continuing from the new θ_g. Raises GroupBroken (after undoing the
        block) when the all-reduce fails."""
        import torch

        assert self.channel.joined
        trainer, (f,) = self.trainer, self.fragments
        w = block_weight(self.config.balance == "speed", self.tallies[0], self.took)
        local = trainer.params_flat
        buffer = torch.cat([(f.param.data - local) * w, torch.tensor([w], dtype=local.dtype, device=local.device)])
        try:
            traffic = self.channel.all_reduce("pseudo_grads", buffer, op="sum")
        except (RuntimeError, OSError) as e:
            self._undo_block()
            raise GroupBroken(str(e)) from e
        members = float(buffer[-1])
        if members > 0:
            delta = buffer[:-1].div_(members)
            if self.finite(all_finite(delta), "averaged pseudo-gradient"):
                f.param.grad = delta
                f.outer.step()
                f.param.grad = None
            self.outer_steps += 1
        local.copy_(f.param.data)
        self.block_start_optimizer = trainer.flat_optimizer_state()
        self.took, self.tallies = 0, [ShareTally()]
        book_round(rows, traffic, self.outer_steps)  # the round's time and bytes go on the block's last row

    def _undo_block(self) -> None:
        """Back to θ_g and the block's starting inner optimizer state: nothing of the block stands."""
        (f,) = self.fragments
        self.trainer.params_flat.copy_(f.param.data)
        self.trainer.load_flat_optimizer_state(self.block_start_optimizer)
        self.took, self.tallies = 0, [ShareTally()]
