"""--balance speed: the driver moves each worker's share of a step's batch towards its measured speed.

Fed the step rows' compute times and samples, it keeps each worker's recent seconds per sample (the
median of its last `window` rows: a worker's compute time, injected slowdowns included, grows with its
batch, so per sample it is a speed that does not depend on the share it had). At a segment's start
(`shares_for`) it proposes shares b_i proportional to 1 / (seconds per sample), cut by
trainers/shares.py, and moves to them only when the predicted step time, the slowest worker's
b_i x s_i, falls by more than `hysteresis` (10 %), or by more than three standard errors of the
measured speeds where the machine is noisier than that: measurement noise between equal workers then
leaves the shares where they are instead of moving them every segment.

Every worker's segment starting at the same step gets the same shares (the decision for a step is made
once, by whichever worker is dealt it first, and remembered), so each step's samples are still cut
into blocks that cover it exactly once. Pure: tested on plain numbers (tests/unit/test_balance.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from distrain.trainers.shares import split_batch

HYSTERESIS = 0.10  # the predicted step time must fall by more than this for the shares to move
WINDOW = 20  # rows per worker the speed is the median of
MIN_ROWS = 10  # rows each worker needs before any move
# On a noisy machine the margin is this many standard errors of the speeds' medians when that exceeds the
# hysteresis: a move must be worth more than what the measurements can tell apart.
NOISE_MARGIN = 3.0


def step_time(shares: Sequence[int], seconds_per_sample: Sequence[float]) -> float:
    """A synchronous step's compute time: the slowest worker's b_i x s_i."""
    return max(b * s for b, s in zip(shares, seconds_per_sample, strict=True))


class ShareBalancer:
    def __init__(
        self,
        workers: int,
        global_batch: int,
        initial: Sequence[int] | None = None,
        hysteresis: float = HYSTERESIS,
        window: int = WINDOW,
        min_rows: int = MIN_ROWS,
    ) -> None:
        self.global_batch = global_batch
        self.hysteresis = hysteresis
        self.min_rows = min_rows
        self.current = tuple(initial) if initial is not None else split_batch(global_batch, [1.0] * workers)
        self.recent = [deque[float](maxlen=window) for _ in range(workers)]
        self.decided: dict[int, tuple[int, ...]] = {}  # segment start step -> its shares
        self.moves: list[dict[str, Any]] = []  # every change: the step it applies from, the shares

    def add(self, workers: Sequence[int], compute_s: Sequence[float], samples: Sequence[int]) -> None:
        for worker, seconds, n in zip(workers, compute_s, samples, strict=True):
            if n and seconds is not None and seconds > 0:
                self.recent[worker].append(seconds / n)

    def speeds(self) -> list[float] | None:
        """Each worker's recent seconds per sample; None until every worker has `min_rows` rows."""
        if any(len(r) < self.min_rows for r in self.recent):
            return None
        return [statistics.median(r) for r in self.recent]

    def noise(self) -> float:
        """The largest relative standard error of a worker's median seconds per sample (1.4826 x the
        median absolute deviation estimates the spread; the median's error is ~1.25 x spread / sqrt(n))."""
        errors = []
        for r in self.recent:
            median = statistics.median(r)
            mad = statistics.median(abs(x - median) for x in r)
            errors.append(1.25 * 1.4826 * mad / math.sqrt(len(r)) / median if median > 0 else 0.0)
        return max(errors, default=0.0)

    def proposal(self) -> tuple[int, ...]:
        """The shares to run from now on: proportional to speed where that predicts a step faster by more
        than the hysteresis, else the current ones."""
        per_sample = self.speeds()
        if per_sample is None or min(per_sample) <= 0:
            return self.current
        proposed = split_batch(self.global_batch, [1.0 / s for s in per_sample])
        margin = max(self.hysteresis, NOISE_MARGIN * self.noise())
        if step_time(self.current, per_sample) > (1 + margin) * step_time(proposed, per_sample):
            return proposed
        return self.current

    def shares_for(self, start_step: int) -> tuple[int, ...]:
        """The shares of the segment starting at global step `start_step` (the same for every worker)."""
        if start_step not in self.decided:
            shares = self.proposal()
            if shares != self.current:
                self.moves.append({"step": start_step, "shares": list(shares)})
                self.current = shares
            self.decided[start_step] = shares  # (one entry per segment: a few hundred in a long run)
        return self.decided[start_step]

    def summary(self) -> dict[str, Any]:
        """For summary.json: the shares at the end and every move (step, shares)."""
        return {"final_shares": list(self.current), "moves": self.moves}
