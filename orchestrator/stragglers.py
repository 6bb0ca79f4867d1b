"""Straggler detection from the step times workers record.

A worker's pace is the median of its last `window` compute times (forward, backward and any
injected delay: the time a step takes this worker before it communicates, so waiting for others
never makes a fast worker look slow). A worker is a straggler while its pace is at least
`threshold` times the median pace of the *other* workers; comparing with the others (not with a
group median that includes the worker itself) keeps the rule meaningful with two workers.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any


class StragglerDetector:
    def __init__(self, workers: int, threshold: float = 2.0, window: int = 20, min_steps: int = 5) -> None:
        self.threshold = threshold
        self.min_steps = min_steps
        self.recent = [deque[float](maxlen=window) for _ in range(workers)]
        self.flagged: dict[int, float] = {}  # worker -> pace ratio when last judged slow
        self.first_seen: dict[int, int] = {}  # worker -> global step at which it was first flagged

    def add(self, workers: Sequence[int], compute_s: Sequence[float]) -> None:
        for worker, seconds in zip(workers, compute_s, strict=True):
            self.recent[worker].append(seconds)

    def ratios(self) -> dict[int, float]:
        """Each worker's pace over the others' median pace (workers with too few steps left out)."""
        paces = {w: statistics.median(r) for w, r in enumerate(self.recent) if len(r) >= self.min_steps}
        out = {}
        for worker, pace in paces.items():
            others = [p for w, p in paces.items() if w != worker]
            if others and statistics.median(others) > 0:
                out[worker] = pace / statistics.median(others)
        return out

    def update(self, step: int) -> bool:
        """Re-judge every worker; True when the set of stragglers changed."""
        now = {w: r for w, r in self.ratios().items() if r >= self.threshold}
        changed = set(now) != set(self.flagged)
        for worker in now:
            self.first_seen.setdefault(worker, step)
        self.flagged = now
        return changed

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
