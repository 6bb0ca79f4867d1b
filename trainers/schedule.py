"""Learning-rate scaling for large global batches and gradual warmup (Goyal et al. 2017).

eta = eta_base * (global_batch / base_batch) for "linear", the square root of that ratio for "sqrt",
eta_base for "none". During the first W epochs the rate rises linearly, step by step, from eta_base to
the scaled eta; after that it stays at the scaled eta (a constant schedule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown lr scaling rule {rule!r}")


@dataclass(frozen=True)
class LRSchedule:
    base_lr: float
    peak_lr: float
    warmup_steps: int

    @classmethod
    def create(
        cls,
        base_lr: float,
        global_batch: int,
        base_batch: int,
        rule: str,
        warmup_epochs: float,
        steps_per_epoch: int,
    ) -> LRSchedule:
        peak = scaled_lr(base_lr, global_batch, base_batch, rule)
        return cls(base_lr, peak, int(round(warmup_epochs * steps_per_epoch)))

    def lr_at(self, step: int) -> float:
        """Rate for global step `step` (0-based)."""
        if self.warmup_steps <= 0 or step >= self.warmup_steps:
            return self.peak_lr
        return self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
