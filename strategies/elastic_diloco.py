"""DiLoCo over the collective transport under `--workers MIN..MAX` (issue 18): `ElasticDiLoCo`.

It runs through the same re-form loop as elastic local SGD (orchestrator/elastic_collective.py): the
driver deals blocks of H = `--sync-every` rounds, each member takes an inner step on each of its units
(a placeholder unit: no step, its inner optimizer state stays), and the block ends in the outer round
(`settle`), so a block boundary is an outer-step boundary: every member holds θ_g there, and that is
the only place the group re-forms. The outer round all-reduces [Σ w·(θ_g − θ_i), Σ w] with w = 1 for a
member that took an inner step in the block, so the pseudo-gradient is the mean over the members that
trained, whatever their number; the outer optimizer then steps θ_g on every member on identical
inputs, as in the fixed-size run (strategies/diloco.py).

What a joiner gets by broadcast (orchestrator/worker.py `TrainWorker.reform`): θ_g (the parameters),
a live member's inner optimizer state (as a schedule hands DiLoCo one), and `extra_state`, the outer
optimizer's state and outer step count, which every member holds identically. Nothing from disk.

A failed outer all-reduce (a peer lost) undoes the block on every survivor: back to θ_g and the inner
optimizer state of the block's start; the block's rows are dropped and its units redone after the
re-form. An inner step's rate follows the members' global batch as elastic local SGD's does
(`lr_factor`). Streaming DiLoCo (`--fragments` > 1, `--overlap-steps`) is refused with a range: its
fragments synchronise inside a block, so a change of members could only wait for all of them to land.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats, all_finite
from distrain.strategies.diloco import DiLoCo, Fragment
from distrain.strategies.elastic_bsp import GroupBroken, ReformedGroup, lr_factor

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.trainers.local_trainer import LocalTrainer


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
        self.fragments = [Fragment.create(0, trainer.numel, 0, trainer.params_flat, self.options)]
        self.sitting = False
        self.reformed(trainer)

    def reformed(self, trainer: LocalTrainer) -> None:
        """After a re-form's broadcast (or at set-up): the replica's θ is θ_g, the block starts here."""
        for f in self.fragments:
            f.param.data.copy_(trainer.params_flat[f.lo : f.hi])
        self.block_start_optimizer = trainer.flat_optimizer_state()
        self.took = 0  # inner steps taken in this block

    def sit_out(self, trainer: LocalTrainer) -> None:
        """No unit for this member in this round: no inner step (its optimizer state stays)."""
        self.sitting = True

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        assert self.channel.joined, "reform() must run before step()"
        size = self.channel.world_size
        stats = CommStats(tau=self.options.sync_every, averaging_round=self.outer_steps, extra={"members": size})
        if self.sitting:
            self.sitting = False
            return stats
        c = self.config
        stats.lr = lr * lr_factor(size, c.worker_slots, c.batch_size, c.base_batch_size, c.lr_scaling)
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
        w = 1.0 if self.took else 0.0
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
        self.took = 0
        if rows.get("comm_s"):  # the round's time and bytes go on the block's last row
            rows["comm_s"][-1] += traffic.seconds
            rows["bytes_sent"][-1] += traffic.sent
            rows["bytes_received"][-1] += traffic.received
            rows["averaging_round"][-1] = self.outer_steps

    def _undo_block(self) -> None:
        """Back to θ_g and the block's starting inner optimizer state: nothing of the block stands."""
        (f,) = self.fragments
        self.trainer.params_flat.copy_(f.param.data)
        self.trainer.load_flat_optimizer_state(self.block_start_optimizer)
        self.took = 0
