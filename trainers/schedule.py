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

The rates come from torch.optim.lr_scheduler (`torch_scheduler`: LinearLR for the warmup, then
CosineAnnealingLR or StepLR, chained by SequentialLR) stepped on a one-value optimizer: torch's recursive
forms give the closed forms above to the last few bits (tests/unit/test_lr_schedule.py holds them to it
for every step). A warmup that falls (a global batch below --base-batch-size under linear scaling) is a
LambdaLR, as LinearLR only rises; past a cosine's horizon the rate stays at the floor, and so does a step
decay's past the run's end.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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
    # The torch scheduler walking the steps forward, and the step whose rate its optimizer holds.
    _cursor: Any = field(default=None, init=False, repr=False, compare=False)

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
        """Rate for global step `step` (0-based): the torch scheduler's, walked forward from step 0 once
        (the rates met on the way are kept, so an earlier step, as a resumed run's, is a look-up)."""
        if self.decay in ("cosine", "step") and self.total_steps > 0:
            step = min(step, self.total_steps)  # past the horizon: the rate the run ends at
        if self.decay == "none" and step >= self.warmup_steps:
            return self.peak_lr  # constant: what torch's chain ends in (ConstantLR of factor 1), to the bit
        if self._cursor is None:
            scheduler = self.torch_scheduler()
            object.__setattr__(self, "_cursor", (scheduler, [float(scheduler.optimizer.param_groups[0]["lr"])]))
        scheduler, rates = self._cursor
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": nothing to update here
            warnings.simplefilter("ignore", UserWarning)
            while len(rates) <= step:
                scheduler.step()
                rates.append(float(scheduler.optimizer.param_groups[0]["lr"]))
        return rates[step]

    def torch_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        """This schedule as torch schedulers over a one-value SGD whose rate is step 0's."""
        import torch
        from torch.optim import lr_scheduler

        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=self.peak_lr)
        warmup = max(self.warmup_steps, 0)
        parts: list[lr_scheduler.LRScheduler] = []
        if warmup > 0:
            start = self.base_lr / self.peak_lr
            if start <= 1:
                parts.append(lr_scheduler.LinearLR(optimizer, start_factor=start, end_factor=1.0, total_iters=warmup))
            else:  # a falling warmup, which LinearLR refuses
                base, peak = self.base_lr, self.peak_lr
                parts.append(
                    lr_scheduler.LambdaLR(optimizer, lambda t: (base + (peak - base) * min(t, warmup) / warmup) / peak)
                )
        span = self.total_steps - warmup
        if self.decay == "cosine" and span > 0:
            parts.append(lr_scheduler.CosineAnnealingLR(optimizer, T_max=span, eta_min=self.min_lr))
        elif self.decay == "step":
            parts.append(lr_scheduler.StepLR(optimizer, step_size=self.decay_every, gamma=self.gamma))
        else:
            parts.append(lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0))
        if len(parts) == 1:
            return parts[0]
        return lr_scheduler.SequentialLR(optimizer, parts, milestones=[warmup])
