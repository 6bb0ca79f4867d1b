"""The group that bsp (collective), local-sgd and diloco share under `--workers MIN..MAX` (issue 18): a
process group re-formed, from the members' in-memory state, whenever the membership changes. Their
variants (`ElasticBSP`, `ElasticLocalSGD`, `ElasticDiLoCo`) sit beside the strategy each one runs.

The driver (orchestrator/block_dispatcher.py's blocks in the controller's loop, its scaling policy in
collective_scaling.py) deals each step's MAX slices out in *rounds*: one unit per member per round, so a
round's update is the mean gradient of N' x B samples (N' the members now). The last round of an epoch
may have fewer units than members: a member without one sits it out (a placeholder unit, slice -1) and
adds a zero gradient of weight 0. So every round all-reduces one buffer [Σ g_i·w_i, Σ w_i, Σ lr_i·w_i] and
divides by the count of real units.

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
from typing import TYPE_CHECKING, Any

from distrain.trainers.schedule import scaled_lr

if TYPE_CHECKING:
    import torch

    from distrain.config import RunConfig
    from distrain.strategies.base import StrategyContext
    from distrain.strategies.channel import Channel, Traffic


# Words in a worker's error that mean a peer of its collective group went away (gloo / NCCL / TCP store).
PEER_LOST_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "closed", "broken pipe", "reset by peer")


class GroupBroken(Exception):
    """The round's all-reduce failed (a peer left without warning); nothing of it was applied."""


def peer_lost(error: BaseException) -> bool:
    """Whether a collective's error says a peer went away (gloo or NCCL on a closed connection, the
    group's timeout): the error types torch.distributed raises, with its words (`PEER_LOST_MARKERS`, which
    orchestrator/recovery.py reads too); a model's own RuntimeError stays the user's."""
    text = str(error).lower()
    return isinstance(error, RuntimeError | OSError) and any(m in text for m in PEER_LOST_MARKERS)


def lr_factor(units: int, slots: int, batch_size: int, base_batch: int, rule: str) -> float:
    """What the schedule's rate (set for the configured global batch, `slots` x B) is multiplied by for
    a round of `units` x B samples, under --lr-scaling `rule`."""
    return scaled_lr(1.0, units * batch_size, base_batch, rule) / scaled_lr(1.0, slots * batch_size, base_batch, rule)


def param_digest(params: torch.Tensor) -> str:
    """A short fingerprint of the parameters: equal digests, equal bytes (the re-form's check)."""
    return hashlib.sha1(params.detach().cpu().numpy().tobytes()).hexdigest()[:16]


def book_round(rows: dict[str, list[Any]], traffic: Traffic, rounds: int) -> None:
    """A block's averaging (outer) round, on the block's last row: its seconds and bytes, and the rounds so
    far (elastic local SGD and DiLoCo, over plain or cut replicas)."""
    if rows.get("comm_s"):
        rows["comm_s"][-1] += traffic.seconds
        rows["bytes_sent"][-1] += traffic.sent
        rows["bytes_received"][-1] += traffic.received
        rows["averaging_round"][-1] = rounds


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



