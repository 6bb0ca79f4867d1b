"""--balance speed: the driver moves each worker's share of a step's batch towards its measured speed.

Fed the step rows' compute times and samples, it models each worker's step time as affine in its share,
t_i(b) = a_i + c_i·b (a fixed cost per step plus a cost per sample: compute time, injected slowdowns
included, grows with the batch but not in proportion where per-step overheads weigh). The model is
anchored at the worker's current share (the median of its last `window` rows there) and its slope is
fitted by least squares to the medians at the other shares it ran recently, those far enough from the
current one to be told apart through the noise; with no such share yet it is linear (a_i = 0, the
seconds per sample measured). At a segment's start (`shares_for`) it proposes the shares that minimise
the predicted step time max_i t_i(b_i) (water-filling, cut by largest remainder, each ≥ 1,
trainers/shares.py) and moves to them only when that time falls by more than `hysteresis` (10 %), or by
more than three standard errors of the measured medians where the machine is noisier than that:
measurement noise between equal workers then leaves the shares where they are, and once the fitted
model says no share can do better by the hysteresis, the shares stop moving.

A move that promises less than `at_once` (the step 1.5x faster) must be seen twice, the second time
on rows measured after the first: the move is pending until every worker has a window of new rows at
its share (as many as the first look had, so the noise margin is no wider), and it is made only if
those rows (with the older rows at other shares, for the slope) still predict a gain past the margin,
moving the shares the same way. The margin judges the spread of times inside a window, not a shift of
a whole window: on a 2-core machine one worker's 2 ms steps ran ~1.45x slower than the other's for
~20 steps and then did not, and that one window moved two equal workers to 38/26 (a CI run of
test_heterogeneous's noise test). A lasting slowdown shows again in the new rows; a passing one does
not. A clear one (between two workers, one 2x slower or more) moves at once.

Why affine: a linear model (seconds per sample) predicts a slow worker's step shrinking in proportion
to its share, so where fixed costs dominate it moves the shares in small steps, each predicting a gain
above the hysteresis that the next measurement does not show. With two shares measured, the affine fit
predicts what a move gains and goes to the optimum in one move.

Every worker's segment starting at the same step gets the same shares (the decision for a step is made
once, by whichever worker is dealt it first, and remembered), so each step's samples are still cut
into blocks that cover it exactly once. Pure: tested on plain numbers (tests/unit/test_balance.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distrain.trainers.shares import split_batch

HYSTERESIS = 0.10  # the predicted step time must fall by more than this for the shares to move
WINDOW = 20  # rows at the current share whose median anchors a worker's model
MIN_ROWS = 10  # rows each worker needs at its current share before any move
HISTORY = 60  # rows per worker kept for the slope: about three windows, so the shares before a move are in it
# A share counts for the slope only when it differs from the current one by this fraction: nearby shares'
# times differ by less than their noise, and a slope between them could be anything.
MIN_SPAN = 0.2
# The fitted fixed cost is at most this fraction of the step's time at the current share (so the slope is
# at least 5 % of the seconds per sample): a flat or falling fit is noise, and a worker whose time did not
# depend on its batch at all would be handed the whole batch.
MAX_FIXED = 0.95
# On a noisy machine the margin is this many standard errors of the medians when that exceeds the
# hysteresis: a move must be worth more than what the measurements can tell apart.
NOISE_MARGIN = 3.0
# A move predicted to make the step faster by more than this (x1.5) is made at once; a smaller one must be
# confirmed by rows measured after it was first proposed.
AT_ONCE = 0.5


@dataclass(frozen=True)
class StepModel:
    """One worker's step time at a share of b samples: fixed_s + per_sample_s x b."""

    fixed_s: float
    per_sample_s: float

    def time(self, samples: float) -> float:
        return self.fixed_s + self.per_sample_s * samples


def step_time(shares: Sequence[int], seconds_per_sample: Sequence[float]) -> float:
    """A synchronous step's compute time under a linear model: the slowest worker's b_i x s_i."""
    return max(b * s for b, s in zip(shares, seconds_per_sample, strict=True))


def predicted_step_time(shares: Sequence[int], models: Sequence[StepModel]) -> float:
    """A synchronous step's compute time: the slowest worker's t_i(b_i)."""
    return max(m.time(b) for b, m in zip(shares, models, strict=True))


def fit_step_model(rows: Sequence[tuple[int, float]], share: int, window: int = WINDOW) -> StepModel:
    """A worker's affine model from its recent (samples, compute seconds) rows, anchored at the median of
    the last `window` rows at `share` (there must be some); linear where no other share is far enough."""
    anchor = statistics.median([t for b, t in rows if b == share][-window:])
    at: dict[int, list[float]] = {}
    for b, t in rows:
        if abs(b - share) >= MIN_SPAN * share:
            at.setdefault(b, []).append(t)
    linear = anchor / share
    if not at:
        return StepModel(0.0, linear)
    # Least squares through the anchor, each other share's median counted by its rows.
    num = sum(len(ts) * (b - share) * (statistics.median(ts) - anchor) for b, ts in at.items())
    den = sum(len(ts) * (b - share) ** 2 for b, ts in at.items())
    slope = min(max(num / den, (1 - MAX_FIXED) * linear), linear)  # fixed cost in [0, MAX_FIXED x anchor]
    return StepModel(anchor - slope * share, slope)


def balanced_shares(total: int, models: Sequence[StepModel]) -> tuple[int, ...]:
    """The shares of `total` minimising the predicted step time: every worker's t_i(b_i) at one level T
    (b_i = (T - a_i) / c_i), a worker whose b_i would fall below 1 held at 1 and the level found again for
    the rest; then cut by largest remainder (each ≥ 1, sum = total)."""
    held: set[int] = set()
    ideal = [1.0] * len(models)
    while len(held) < len(models):
        free = [i for i in range(len(models)) if i not in held]
        level = (total - len(held) + sum(models[i].fixed_s / models[i].per_sample_s for i in free)) / sum(
            1 / models[i].per_sample_s for i in free
        )
        for i in free:
            ideal[i] = (level - models[i].fixed_s) / models[i].per_sample_s
        below = {i for i in free if ideal[i] < 1}
        if not below:
            break
        held |= below
        for i in below:
            ideal[i] = 1.0
    return split_batch(total, ideal)


class ShareBalancer:
    def __init__(
        self,
        workers: int,
        global_batch: int,
        initial: Sequence[int] | None = None,
        hysteresis: float = HYSTERESIS,
        window: int = WINDOW,
        min_rows: int = MIN_ROWS,
        history: int = HISTORY,
        at_once: float = AT_ONCE,
    ) -> None:
        self.global_batch = global_batch
        self.hysteresis = hysteresis
        self.window = window
        self.min_rows = min_rows
        self.at_once = at_once
        self.current = tuple(initial) if initial is not None else split_batch(global_batch, [1.0] * workers)
        self.rows = [deque[tuple[int, float]](maxlen=max(history, window)) for _ in range(workers)]
        self.decided: dict[int, tuple[int, ...]] = {}  # segment start step -> its shares
        self.moves: list[dict[str, Any]] = []  # every change: the step it applies from, the shares
        self.pending: tuple[int, ...] | None = None  # a move seen once, waiting to be seen in new rows
        self.fresh: list[deque[tuple[int, float]]] = []  # per worker: its rows since `pending` was proposed

    def add(self, workers: Sequence[int], compute_s: Sequence[float], samples: Sequence[int]) -> None:
        for worker, seconds, n in zip(workers, compute_s, samples, strict=True):
            if n and seconds is not None and seconds > 0:
                self.rows[worker].append((int(n), float(seconds)))
                if self.pending is not None:
                    self.fresh[worker].append((int(n), float(seconds)))

    def add_rows(self, rows: dict[str, list[Any]]) -> None:
        """A segment's step rows (columns): each worker's compute time at the share it ran."""
        self.add(rows["worker"], rows["compute_s"], rows["samples"])

    def share_of(self, worker: int) -> int:
        """The share worker `worker`'s rows are measured at now."""
        return self.current[worker]

    def at_current(self, worker: int, rows: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[float]:
        """The worker's last `window` compute times at its current share (in `rows`, by default all kept)."""
        share = self.share_of(worker)
        return [t for b, t in (self.rows if rows is None else rows)[worker] if b == share][-self.window :]

    def models(self, rows: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[StepModel] | None:
        """Each worker's step model from `rows` (by default all kept); None until every worker has
        `min_rows` rows at its current share."""
        rows = self.rows if rows is None else rows
        if any(len(self.at_current(w, rows)) < self.min_rows for w in range(len(rows))):
            return None
        return [fit_step_model(rows[w], self.current[w], self.window) for w in range(len(rows))]

    def noise(self, rows: Sequence[Sequence[tuple[int, float]]] | None = None) -> float:
        """The largest relative standard error of a worker's median time at its current share (1.4826 x the
        median absolute deviation estimates the spread; the median's error is ~1.25 x spread / sqrt(n))."""
        errors = []
        for w in range(len(self.rows if rows is None else rows)):
            times = self.at_current(w, rows)
            median = statistics.median(times)
            mad = statistics.median(abs(x - median) for x in times)
            errors.append(1.25 * 1.4826 * mad / math.sqrt(len(times)) / median if median > 0 else 0.0)
        return max(errors, default=0.0)

    def judge(self, rows: Sequence[Sequence[tuple[int, float]]] | None = None) -> tuple[tuple[int, ...], float] | None:
        """From `rows`: the shares the models predict fastest and the gain they promise (the current shares'
        predicted step time over theirs, less 1), or the current shares when that gain is within the margin;
        None while some worker has too few rows to judge."""
        models = self.models(rows)
        if models is None or min(m.per_sample_s for m in models) <= 0:
            return None
        proposed = balanced_shares(self.global_batch, models)
        gain = predicted_step_time(self.current, models) / predicted_step_time(proposed, models) - 1
        margin = max(self.hysteresis, NOISE_MARGIN * self.noise(rows))
        return (proposed, gain) if gain > margin else (self.current, gain)

    def since_pending(self) -> list[list[tuple[int, float]]]:
        """Each worker's rows for the second look: those at its current share measured since the move was
        first proposed, and the older ones at other shares (they give the model its slope)."""
        return [
            [r for r in self.rows[w] if r[0] != self.share_of(w)] + list(self.fresh[w]) for w in range(len(self.rows))
        ]

    def proposal(self) -> tuple[int, ...]:
        """The shares to run from now on: those the models predict fastest, where that beats the current
        shares' predicted step time by more than the margin and, unless it beats it by `at_once`, the rows
        measured since it was first proposed say so too; else the current ones."""
        judged = self.judge()
        if judged is None or judged[0] == self.current:
            self.pending = None
            return self.current
        proposed, gain = judged
        if gain > self.at_once:
            self.pending = None
            return proposed
        if self.pending is None:  # seen once: look again at new rows
            self.pending = proposed
            self.fresh = [deque(maxlen=self.rows[w].maxlen) for w in range(len(self.rows))]
            return self.current
        rows = self.since_pending()
        if any(len(self.at_current(w, rows)) < self.window for w in range(len(rows))):
            return self.current  # a second look as sharp as the first: a window of new rows
        again = self.judge(rows)
        if again is None:
            return self.current
        first, self.pending = self.pending, None
        if again[0] != self.current and same_way(self.current, first, again[0]):
            return again[0]
        return self.current

    def shares_for(self, start_step: int) -> tuple[int, ...]:
        """The shares of the segment starting at global step `start_step` (the same for every worker)."""
        if start_step not in self.decided:
            shares = self.proposal()
            if shares != self.current:
                self.moves.append({"step": start_step, "shares": list(shares)})
                self.current = shares
                self.pending = None
            self.decided[start_step] = shares  # (one entry per segment: a few hundred in a long run)
        return self.decided[start_step]

    def summary(self) -> dict[str, Any]:
        """For summary.json: the shares at the end and every move (step, shares)."""
        return {"final_shares": list(self.current), "moves": self.moves}


def same_way(current: Sequence[int], first: Sequence[int], again: Sequence[int]) -> bool:
    """Whether two proposed moves from `current` go the same way: no worker gains in one and loses in the
    other, and some worker moves in both."""
    pairs = [(a - c, b - c) for c, a, b in zip(current, first, again, strict=True)]
    return all(x * y >= 0 for x, y in pairs) and any(x * y > 0 for x, y in pairs)
