"""DiLoCo, distributed low-communication training (Douillard et al. 2023): `--strategy diloco`.

Every replica keeps the last synchronised parameters θ_g. It takes H = `--sync-every` inner steps with
the run's optimizer (`--optimizer`, `--lr`, ...: the *inner* optimizer, whose state stays on the
replica and is never averaged) from θ_g to θ_i. Then one all-reduce averages the pseudo-gradients
Δ_i = θ_g − θ_i, and an *outer* optimizer takes one step on θ_g with gradient Δ = mean Δ_i
(`--outer-optimizer`, default SGD with Nesterov momentum, `--outer-lr 0.7`, `--outer-momentum 0.9`,
the paper's). Every replica then continues from the new θ_g. A round moves n values, as local SGD's
θ-only average would; the outer optimizer runs on every replica on identical inputs, so its state
(the Nesterov momentum) is identical everywhere and never travels.

Identities (tests/test_diloco.py): with outer SGD at lr 1 and no momentum, θ_g becomes the plain mean
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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError
from distrain.fields import setting
from distrain.strategies.base import CommStats, Strategy, StrategyContext, StrategyOptions, all_finite
from distrain.strategies.network import Link
from distrain.strategies.registry import STRATEGIES

if TYPE_CHECKING:
    import torch

    from distrain.config import RunConfig
    from distrain.strategies.collective import CollectiveGroup
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
        if self.outer_optimizer != "sgd" and self.outer_momentum is not None:
            raise ConfigError(f"--outer-momentum applies to --outer-optimizer sgd, not {self.outer_optimizer}; drop it")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")

    def make_outer_optimizer(self, param: torch.nn.Parameter) -> torch.optim.Optimizer:
        from distrain.trainers.optim_state import make_optimizer

        if self.outer_optimizer == "sgd":
            momentum = self.outer_momentum or 0.0
            return make_optimizer("sgd", [param], self.outer_lr, momentum, None, {"nesterov": momentum > 0})
        return make_optimizer(self.outer_optimizer, [param], self.outer_lr)


@STRATEGIES.register("diloco", "DiLoCo: H inner steps, then an outer optimizer step on the averaged pseudo-gradient")
class DiLoCo(Strategy):
    name = "diloco"
    transports = ("collective",)
    Options = DiLoCoOptions
    # The inner rate: at the run's 0.05 (SGD, momentum 0.9) the outer Nesterov step overshoots on the
    # default task (test accuracy 0.95 at 4.5 s, then oscillating down to 0.90 by epoch 12); 0.01 ends at 0.99.
    run_defaults = {"lr": 0.01}

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.group: CollectiveGroup | None = None
        self.global_param: torch.nn.Parameter | None = None  # θ_g: equal on every replica
        self.outer: torch.optim.Optimizer | None = None
        self.pending = 0  # inner steps since the last outer step
        self.outer_steps = 0

    def setup(self, trainer: LocalTrainer) -> None:
        import torch

        from distrain.strategies.collective import CollectiveGroup

        backend = "nccl" if self.ctx.device.startswith("cuda") else "gloo"
        self.group = CollectiveGroup(
            self.ctx.rank,
            self.ctx.world_size,
            self.ctx.rendezvous,
            backend,
            self.config.collective_timeout_s,
            Link.of(self.config),
        )
        self.group.broadcast_(trainer.params_flat, src=0)  # replicas start from one θ_g
        self.global_param = torch.nn.Parameter(trainer.params_flat.detach().clone())
        self.outer = self.options.make_outer_optimizer(self.global_param)

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        # An inner step is the replica's own: decided on its own loss and gradient (skipped: no update).
        ok = self.finite(math.isfinite(trainer.last_loss) and all_finite(trainer.grads_flat), "loss or gradient")
        if ok:
            trainer.apply_update(lr)
        self.pending += 1
        stats = self.outer_step(trainer) if self.pending >= self.options.sync_every else CommStats()
        stats.tau = self.options.sync_every  # the step rows' tau and averaging_round: H and outer steps so far
        stats.averaging_round = self.outer_steps
        if not ok:
            stats.nonfinite = True
        return stats

    def at_epoch_end(self, trainer: LocalTrainer) -> CommStats | None:
        if self.pending == 0:
            return None
        stats = self.outer_step(trainer)
        stats.averaging_round = self.outer_steps
        return stats

    def outer_step(self, trainer: LocalTrainer) -> CommStats:
        """All-reduce the pseudo-gradients θ_g − θ_i, step the outer optimizer on θ_g, restart from it."""
        from distrain.strategies.collective import ring_allreduce_bytes

        assert self.group is not None and self.global_param is not None and self.outer is not None
        theta_g = self.global_param.data
        delta = theta_g - trainer.params_flat
        seconds = self.group.all_reduce_mean_(delta)
        # Every replica holds the same mean, so all agree. Skipped, the round is discarded: every
        # replica goes back to θ_g (its inner optimizer state stays as it is).
        finite = self.finite(all_finite(delta), "averaged pseudo-gradient")
        if finite:
            self.global_param.grad = delta
            self.outer.step()
            self.global_param.grad = None
        trainer.params_flat.copy_(theta_g)
        self.outer_steps += 1
        self.pending = 0
        moved = ring_allreduce_bytes(delta.numel() * delta.element_size(), self.ctx.world_size)
        return CommStats(seconds=seconds, bytes_sent=moved, bytes_received=moved, nonfinite=None if finite else True)

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        # a schedule's other phases leave the column empty (None, or NaN once it went through pandas)
        rounds = [r for r in steps.get("averaging_round", []) if r is not None and r == r]
        return {"outer_steps": int(max(rounds)) if rounds else 0}

    def extra_state(self) -> dict[str, Any]:
        """The outer optimizer's state (flat) and the outer steps so far: equal on every replica."""
        from distrain.trainers.optim_state import export_flat_state

        assert self.outer is not None and self.global_param is not None
        return {
            "outer_steps": self.outer_steps,
            "outer_optimizer": export_flat_state(self.outer, [self.global_param]).to_dict(),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        from distrain.trainers.optim_state import FlatOptimizerState, import_flat_state

        assert self.outer is not None and self.global_param is not None
        self.outer_steps = int(state["outer_steps"])
        import_flat_state(self.outer, [self.global_param], FlatOptimizerState.from_dict(state["outer_optimizer"]))

    def teardown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
