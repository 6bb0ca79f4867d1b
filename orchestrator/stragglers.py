"""Straggler detection from the step times workers record.

A worker's pace is the median of its last `window` compute times (forward, backward and any
injected delay: the time a step takes this worker before it communicates, so waiting for others
never makes a fast worker look slow). Comparing with the median pace of the *other* workers (not
with a group median that includes the worker itself) keeps the rule meaningful with two workers.

A worker is slow at a judgement when its pace is both
- relatively slow: at least `threshold` times the others' median, and
- absolutely slow: at least `min_excess_s` (10 ms) more per step. Below that a slowdown costs a run
  little and is what time-sharing alone does: with more processes than cores the scheduler's slices
  are a few milliseconds, so a model whose steps take a millisecond or less is "2x slower" whenever
  another process takes its core for one slice. A ratio alone flagged a 5-parameter model's workers.

It is flagged only when it stays slow at every judgement over `window` more steps of its own (two
disjoint windows, both slow), so a one-off burst (one segment's worth of steps slowed by something
else on the machine: "2.1x" then "none now" two segments later) is not reported. A flagged worker is
released with hysteresis: only once it has stayed clearly fine, under half the flagging margins
(pace ratio below 1 + (threshold - 1) / 2, or under min_excess_s / 2 slower), over a window of its
own steps, so a straggler near the threshold does not flap on and off.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

MIN_EXCESS_S = 0.010  # seconds per step slower than the others' median before a worker can be flagged


class StragglerDetector:
    def __init__(
        self,
        workers: int,
        threshold: float = 2.0,
        window: int = 20,
        min_steps: int = 5,
        min_excess_s: float = MIN_EXCESS_S,
    ) -> None:
        self.threshold = threshold
        self.window = window
        self.min_steps = min_steps
        self.min_excess_s = min_excess_s
        self.recent = [deque[float](maxlen=window) for _ in range(workers)]
        self.steps_seen = [0] * workers  # compute times added per worker: its own clock for persistence
        self.flagged: dict[int, float] = {}  # worker -> pace ratio when last judged
        self.first_seen: dict[int, int] = {}  # worker -> global step at which it was first flagged
        self._since: dict[int, int] = {}  # worker -> steps_seen when its current run of verdicts began

    def add(self, workers: Sequence[int], compute_s: Sequence[float]) -> None:
        for worker, seconds in zip(workers, compute_s, strict=True):
            self.recent[worker].append(seconds)
            self.steps_seen[worker] += 1

    def paces(self) -> dict[int, tuple[float, float]]:
        """Each worker's (pace ratio, seconds per step over) the others' median pace (workers with too
        few steps left out)."""
        paces = {w: statistics.median(r) for w, r in enumerate(self.recent) if len(r) >= self.min_steps}
        out = {}
        for worker, pace in paces.items():
            others = statistics.median([p for w, p in paces.items() if w != worker] or [0.0])
            if others > 0:
                out[worker] = (pace / others, pace - others)
        return out

    def ratios(self) -> dict[int, float]:
        """Each worker's pace over the others' median pace."""
        return {w: ratio for w, (ratio, _) in self.paces().items()}

    def _slow(self, ratio: float, excess: float) -> bool:
        return ratio >= self.threshold and excess >= self.min_excess_s

    def _fine(self, ratio: float, excess: float) -> bool:
        return ratio < 1 + (self.threshold - 1) / 2 or excess < self.min_excess_s / 2

    def update(self, step: int) -> bool:
        """Re-judge every worker; True when the set of flagged workers changed."""
        before = set(self.flagged)
        for worker, (ratio, excess) in self.paces().items():
            flagged = worker in self.flagged
            # What would change the verdict: slow for an unflagged worker, clearly fine for a flagged one.
            turning = self._fine(ratio, excess) if flagged else self._slow(ratio, excess)
            if not turning:
                self._since.pop(worker, None)  # the run of contrary verdicts is broken
                if flagged:
                    self.flagged[worker] = ratio
                continue
            since = self._since.setdefault(worker, self.steps_seen[worker])
            if self.steps_seen[worker] - since < self.window:  # not yet held over a window of its own steps
                if flagged:
                    self.flagged[worker] = ratio
                continue
            del self._since[worker]
            if flagged:
                del self.flagged[worker]
            else:
                self.flagged[worker] = ratio
                self.first_seen.setdefault(worker, step)
        return set(self.flagged) != before

    def summary(self) -> dict[str, dict[str, Any]]:
        """Every worker ever flagged: step of first detection, whether it still is, latest pace ratio."""
        ratios = self.ratios()
        return {
            str(w): {
                "first_detected_step": step,
                "flagged_at_end": w in self.flagged,
                "pace_ratio": round(ratios.get(w, float("nan")), 2),
            }
            for w, step in sorted(self.first_seen.items())
        }
