"""Heterogeneous workers' shares of a step: how a global batch of B samples is cut into unequal parts.

Worker i of N takes b_i samples of every step (sum b_i = B, each b_i >= 1), in proportion to its weight
w_i: a measured throughput (--balance speed) or a known speed (--worker-weights). The parts are
contiguous sub-blocks of the step's samples in rank order, so the step still uses exactly the samples one
process at batch B would, and each worker's gradient, weighted by b_i * N / B before the mean all-reduce
or push, makes the update that process's (docs/heterogeneous.md). Pure arithmetic: no torch, no numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from distrain.errors import ConfigError


def split_batch(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """`total` samples cut in proportion to `weights` by largest remainder (ties to the lower rank), each
    part >= 1: a part that rounds to 0 takes a sample from the largest part (a worker with no samples would
    have no gradient to weigh, and its speed could not be measured again)."""
    n = len(weights)
    if n == 0:
        raise ConfigError("no workers to share a batch between")
    if total < n:
        raise ConfigError(f"a global batch of {total} cannot give each of {n} workers a sample; raise --batch-size")
    if not all(w > 0 and math.isfinite(w) for w in weights):
        raise ConfigError(f"worker weights must be positive numbers, got {list(weights)}")
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    parts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(n), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    for i in range(n):
        if parts[i] == 0:
            parts[max(range(n), key=lambda j: (parts[j], -j))] -= 1
            parts[i] = 1
    return tuple(parts)


def share_bounds(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """[start, stop) of worker `rank`'s contiguous block within a step's samples."""
    start = sum(shares[:rank])
    return start, start + shares[rank]


def gradient_weight(samples: int, workers: int, total: int) -> float:
    """The factor a worker's mean gradient over `samples` of a step's `total` is multiplied by before a mean
    over `workers`: b_i * N / B, so the mean is sum_i b_i g_i / B, the whole batch's mean gradient."""
    return samples * workers / total


class ShareTally:
    """The samples a worker took of its steps' samples since its replica last joined an average (local
    SGD's round, a DiLoCo fragment's outer step). Under unequal shares the average weighs each replica by
    them: the period's mean over the workers of tally weight x value is sum_i m_i / T x value_i, each
    replica counted by the samples it trained on (T: the steps' samples, the same on every worker)."""

    def __init__(self) -> None:
        self.mine = 0
        self.total = 0

    def add(self, samples: int, step_samples: int) -> None:
        self.mine += samples
        self.total += step_samples

    def take(self, workers: int) -> float:
        """This worker's weight for the average now (1 without a tally), and start counting afresh."""
        weight = gradient_weight(self.mine, workers, self.total) if self.total else 1.0
        self.mine = self.total = 0
        return weight


def block_weight(balanced: bool, tally: ShareTally, took: int) -> float:
    """A member's weight in an elastic block's average (local SGD's θ, DiLoCo's pseudo-gradient), which is
    divided by the members' sum: 1 for a member that took a step (0 for one that only sat out); under
    --balance speed the samples it trained on in the block (`tally`), so the average is Σ m_i x_i / Σ m_i,
    each member counted by its share of the block's steps as at a fixed size (Σ m_i = the steps x B)."""
    if balanced:
        return float(tally.mine)
    return 1.0 if took else 0.0


def reshare(shares: Mapping[int, int], members: Sequence[int], total: int) -> dict[int, int]:
    """The shares of a new membership (--workers MIN..MAX): each member that stays keeps its share as its
    weight, each joiner comes in at the mean of those (with nobody staying, all equal), and the weights
    are cut again into `total` by `split_batch` (Σ = total, each >= 1, largest remainder). So a joiner
    starts at the mean share (total / members, to a sample) and a leaver's share goes to the others in
    proportion to theirs; the balancer then moves them from measured times. `shares`: slot -> samples
    per step of the membership before; `members`: the slots after, in the group's order."""
    staying = [shares[m] for m in members if m in shares]
    mean = sum(staying) / len(staying) if staying else 1.0
    cut = split_batch(total, [float(shares.get(m, mean)) for m in members])
    return dict(zip(members, cut, strict=True))


def slot_shares(shares: Mapping[int, int], slots: int) -> tuple[int, ...]:
    """Member shares as one count per slot of the range's MAX (0: no member there), the form a step's
    samples are cut by (`share_bounds`): each member's block is where its slot falls in slot order."""
    return tuple(shares.get(slot, 0) for slot in range(slots))
