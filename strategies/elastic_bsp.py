"""BSP over the collective transport under `--workers MIN..MAX` (issue 18): a process group that is
re-formed, from the members' in-memory state, whenever the membership changes.

The driver (orchestrator/elastic_collective.py) deals each step's MAX slices out in *rounds*: one
unit per member per round, so a round's update is the mean gradient of N' x B samples (N' the
members now). The last round of an epoch may have fewer units than members: a member without one
sits it out (a placeholder unit, slice -1) and adds a zero gradient of weight 0. So every round
all-reduces one buffer [Σ g_i·w_i, Σ w_i, Σ lr_i·w_i] and divides by the count of real units.

The learning rate follows the round's global batch: the schedule's rate (scaled for MAX x B, the
run's configured global batch) times scale(count·B)/scale(MAX·B) under --lr-scaling (linear: count/MAX,
sqrt: its square root, none: 1); `lr_i` is the schedule's rate at member i's unit's step (a round's
units may span two steps of MAX slices), averaged so every replica applies the same rate.

A re-form (`reform`) tears the old group down and joins a new one at a fresh rendezvous address;
the state itself is broadcast by orchestrator/worker.py (`TrainWorker.reform`). A failed all-reduce
(a peer gone: gloo raises on a closed connection, or the group's timeout passes) raises `GroupBroken`
before anything is applied: the round is abandoned and redone after the re-form.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from distrain.strategies.base import CommStats
from distrain.strategies.bsp import BSP
from distrain.strategies.local_sgd import LocalSGD
from distrain.trainers.schedule import scaled_lr

if TYPE_CHECKING:
    import torch

    from distrain.config import RunConfig
    from distrain.strategies.base import StrategyContext
    from distrain.strategies.channel import Channel
    from distrain.trainers.local_trainer import LocalTrainer


class GroupBroken(Exception):
    """The round's all-reduce failed (a peer left without warning); nothing of it was applied."""


def lr_factor(units: int, slots: int, batch_size: int, base_batch: int, rule: str) -> float:
    """What the schedule's rate (set for the configured global batch, `slots` x B) is multiplied by for
    a round of `units` x B samples, under --lr-scaling `rule`."""
    return scaled_lr(1.0, units * batch_size, base_batch, rule) / scaled_lr(1.0, slots * batch_size, base_batch, rule)


def param_digest(params: torch.Tensor) -> str:
    """A short fingerprint of the parameters: equal digests, equal bytes (the re-form's check)."""
    return hashlib.sha1(params.detach().cpu().numpy().tobytes()).hexdigest()[:16]


class ReformedGroup:
    """The process group of an elastic strategy over the collective transport (BSP, local SGD, DiLoCo):
    none until the driver forms one (`reform`), and a new one at every membership change."""

    channel: Channel
    config: RunConfig
    ctx: StrategyContext

    def reform(self, rank: int, size: int, rendezvous: str) -> None:
        """Leave the old group (a broken one too) and join a new one of `size` ranks at `rendezvous`."""
        self.channel.leave(quiet=True)
        self.channel.join(rank, size, rendezvous)

    def teardown(self) -> None:
        self.channel.leave(quiet=True)


class ElasticBSP(ReformedGroup, BSP):
    """BSP over the collective transport whose group can change size between rounds."""

    elastic = True
    metric_columns = {"members": "int32"}  # the group's size when the row's round ran

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.weight = 0.0  # this member's share of the round: 1 for a unit, 0 sitting one out

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        """Rounds the driver deals at a time (between two boundaries where the group may change)."""
        return config.segment_steps

    @property
    def slices_per_step(self) -> int:
        return self.config.worker_slots  # a step is MAX slices whatever the membership

    def setup(self, trainer: LocalTrainer) -> None:
        """No group yet: the driver forms one among the members (`reform`) before the first round."""

    def reformed(self, trainer: LocalTrainer) -> None:
        """After a re-form's broadcast (nothing of BSP's own depends on the state)."""

    def compute_gradients(self, trainer: LocalTrainer, batch: object) -> float:
        self.weight = 1.0
        return super().compute_gradients(trainer, batch)

    def sit_out(self, trainer: LocalTrainer) -> None:
        """This member has no unit in this round: it joins the all-reduce with nothing to add."""
        self.weight = 0.0
        trainer.grads_flat.zero_()
        # Under fp16 every replica must unscale after the all-reduce alike (`usable_gradient`).
        trainer._grads_scaled = trainer.scaler is not None

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        import torch

        assert self.channel.joined, "reform() must run before step()"
        size = self.channel.world_size
        n = trainer.grads_flat.numel()
        buffer = torch.empty(n + 2, dtype=trainer.grads_flat.dtype, device=trainer.grads_flat.device)
        buffer[:n].copy_(trainer.grads_flat)
        buffer[n], buffer[n + 1] = self.weight, lr * self.weight
        try:
            traffic = self.channel.all_reduce("grads", buffer, op="sum")
        except (RuntimeError, OSError) as e:  # gloo: a closed peer, or the group's timeout
            raise GroupBroken(str(e)) from e
        units = int(round(float(buffer[n])))
        if units == 0:  # nobody had a unit (never dealt so): nothing to apply
            return CommStats(seconds=traffic.seconds, extra={"members": size})
        trainer.grads_flat.copy_(buffer[:n]).div_(units)
        rate = float(buffer[n + 1]) / units
        rate *= lr_factor(
            units, self.config.worker_slots, self.config.batch_size, self.config.base_batch_size, self.config.lr_scaling
        )
        applied = self.usable_gradient(trainer, "all-reduced gradient")
        if applied:
            trainer.apply_update(rate)
        return CommStats(
            nonfinite=None if applied else True,
            lr=rate if math.isfinite(rate) else None,
            extra={"members": size},
        ).add(traffic)

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

    def sit_out(self, trainer: LocalTrainer) -> None:
        """No unit for this member in this round: no local step at all (its optimizer state stays)."""
        self.sitting = True

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        assert self.channel.joined, "reform() must run before step()"
        size = self.channel.world_size
        if getattr(self, "sitting", False):
            self.sitting = False
            return CommStats(tau=self.tau, averaging_round=self.rounds, extra={"members": size})
        c = self.config
        rate = lr * lr_factor(size, c.worker_slots, c.batch_size, c.base_batch_size, c.lr_scaling)
        ok = self.usable_gradient(trainer, "loss or gradient", check_loss=True)
        if ok:
            trainer.apply_update(rate)
            self.took += 1
        return CommStats(
            tau=self.tau,
            averaging_round=self.rounds,
            nonfinite=None if ok else True,
            lr=rate,
            extra={"members": size},
        )

    def at_epoch_end(self, trainer: LocalTrainer) -> CommStats | None:
        return None  # blocks never cross an epoch: `settle` averages at its end already

    def settle(self, rows: dict[str, list]) -> None:
        """The block's averaging round: Σ w·(θ_i − θ_anchor), Σ w·state_i, Σ w in one all-reduce, w = 1 for
        a member that took a step. Raises GroupBroken (after going back to the last average) if it fails."""
        import torch

        assert self.channel.joined
        trainer = self.trainer
        n = trainer.numel
        opt = trainer.flat_optimizer_state()
        w = 1.0 if self.took else 0.0
        parts = [(trainer.params_flat - self.anchor) * w]
        parts += [v.to(trainer.params_flat.device) * w for v in opt.vectors.values()]
        parts.append(torch.tensor([w], dtype=trainer.params_flat.dtype, device=trainer.params_flat.device))
        buffer = torch.cat(parts)
        try:
            traffic = self.channel.all_reduce("params", buffer, op="sum")
        except (RuntimeError, OSError) as e:
            trainer.params_flat.copy_(self.anchor)  # the block is undone: back to the last average
            trainer.load_flat_optimizer_state(self.anchor_optimizer)
            self.took = 0
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
        if rows.get("comm_s"):  # the round's time and bytes go on the block's last row
            rows["comm_s"][-1] += traffic.seconds
            rows["averaging_round"][-1] = self.rounds
