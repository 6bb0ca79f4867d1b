"""`distrain plan --worker-speeds 1,1,0.5`: a synchronous step's compute under unequal worker speeds,
with equal shares and with the shares --worker-weights would give (docs/heterogeneous.md).

A worker of speed s (1: the calibrated worker) computes b samples in b / B x compute_s / s, B the
calibrated per-worker batch (compute taken as proportional to the batch: fixed per-step costs make a
small share a little dearer than this says). A synchronous step waits for its slowest worker: with
equal shares max_i compute_s / s_i; with shares b_i proportional to s_i (trainers/shares.py, as
`--worker-weights S1,S2,...` cuts them) about N x compute_s / sum(s). Pure arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass

from distrain.errors import ConfigError
from distrain.trainers.shares import split_batch


@dataclass(frozen=True)
class SharesEffect:
    speeds: tuple[float, ...]
    equal_shares: tuple[int, ...]
    shares: tuple[int, ...]  # the recommended ones: proportional to speed
    equal_step_s: float  # a step's compute with equal shares (the slowest worker's)
    balanced_step_s: float  # with the recommended shares

    @property
    def speedup(self) -> float:
        return self.equal_step_s / self.balanced_step_s

    def text(self) -> str:
        speeds = ",".join(f"{s:g}" for s in self.speeds)
        return (
            f"worker speeds {speeds}: equal shares {'/'.join(map(str, self.equal_shares))} take "
            f"{self.equal_step_s * 1e3:.1f} ms of compute a step (the slowest worker's); "
            f"--worker-weights {speeds} (or --balance speed) gives b = {'/'.join(map(str, self.shares))}: "
            f"{self.balanced_step_s * 1e3:.1f} ms, x{self.speedup:.2f} the samples/s"
        )


def parse_worker_speeds(text: str) -> tuple[float, ...]:
    """ "1,1,0.5" -> (1.0, 1.0, 0.5): one positive number per worker."""
    try:
        speeds = tuple(float(p) for p in str(text).split(","))
    except ValueError:
        speeds = ()
    if not speeds or not all(s > 0 and math.isfinite(s) for s in speeds):
        raise ConfigError(f"--worker-speeds {text!r} must be positive numbers separated by commas, e.g. 1,1,0.5")
    return speeds


def share_effect(compute_s: float, batch_size: int, speeds: tuple[float, ...]) -> SharesEffect:
    """The effect of shares proportional to `speeds` on a step of len(speeds) x `batch_size` samples."""
    total = len(speeds) * batch_size
    equal = split_batch(total, [1.0] * len(speeds))
    shares = split_batch(total, speeds)

    def step_s(cut: tuple[int, ...]) -> float:
        return max(b / batch_size * compute_s / s for b, s in zip(cut, speeds, strict=True))

    return SharesEffect(speeds, equal, shares, step_s(equal), step_s(shares))
