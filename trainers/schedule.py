"""Learning-rate scaling for large global batches, gradual warmup (Goyal et al. 2017), then decay.

eta = eta_base * (global_batch / base_batch) for "linear", the square root of that ratio for "sqrt",
eta_base for "none": the *peak* rate. During the first W epochs the rate rises linearly, step by step,
from eta_base to the peak. After warmup it
- stays at the peak ("none"),
- follows half a cosine from the peak down to `min_lr` over the rest of the run ("cosine"; step t of
  T after warmup runs at min + (peak - min) (1 + cos(pi t / T)) / 2, so the last step is just above
  the floor, as torch's CosineAnnealingLR with T_max = T), or
- is multiplied by `gamma` every `decay_every` steps counted from the end of warmup ("step").
The schedule is a pure function of the global step, so every worker, shard and resumed run agrees on it.
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
    decay: str = "none"  # after warmup: none | cosine | step
    total_steps: int = 0  # cosine: the run's step count (its horizon)
    min_lr: float = 0.0  # cosine: the floor
    decay_every: int = 0  # step: steps between drops
    gamma: float = 0.1  # step: factor per drop

    @classmethod
    def create(
        cls,
        base_lr: float,
        global_batch: int,
        base_batch: int,
        rule: str,
        warmup_epochs: float,
        steps_per_epoch: int,
        *,
        decay: str = "none",
        total_steps: int = 0,
        min_lr: float | None = None,
        decay_epochs: float | None = None,
        gamma: float | None = None,
    ) -> LRSchedule:
        peak = scaled_lr(base_lr, global_batch, base_batch, rule)
        if decay not in ("none", "cosine", "step"):
            raise ValueError(f"unknown lr decay {decay!r}")
        every = max(1, int(round((decay_epochs or 0) * steps_per_epoch))) if decay == "step" else 0
        return cls(
            base_lr,
            peak,
            int(round(warmup_epochs * steps_per_epoch)),
            decay,
            total_steps,
            0.0 if min_lr is None else min_lr,
            every,
            0.1 if gamma is None else gamma,
        )

    def lr_at(self, step: int) -> float:
        """Rate for global step `step` (0-based)."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
        t = step - max(self.warmup_steps, 0)
        if self.decay == "cosine":
            span = self.total_steps - max(self.warmup_steps, 0)
            if span <= 0:
                return self.peak_lr
            frac = min(t, span) / span
            return self.min_lr + (self.peak_lr - self.min_lr) * (1 + math.cos(math.pi * frac)) / 2
        if self.decay == "step":
            return self.peak_lr * self.gamma ** (t // self.decay_every)
        return self.peak_lr
