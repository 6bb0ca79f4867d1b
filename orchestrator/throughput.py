"""Steady-state samples/s: the one definition the summary and the live progress display share.

A global step ends when its last worker finishes it. The figure counts the samples of the global
steps after the warm-up (the first `WARMUP_FRACTION` of the steps seen so far) and divides them by
the time from the end of the last warm-up step to the end of the last step, less the evaluation
pauses inside that window. Rows are added as they arrive, so the display shows, at every moment, the
figure the summary would give if the run ended there; once every row is in, the two are equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

WARMUP_FRACTION = 0.1  # share of global steps left out of the steady-state throughput


class SteadyState:
    def __init__(self) -> None:
        self._samples = np.zeros(0)  # indexed by global step: samples trained on, over all its rows
        self._end = np.full(0, np.nan)  # indexed by global step: when its last row ended (NaN: none yet)
        self._pauses: list[tuple[float, float]] = []  # (wall_time at the end, seconds) of each evaluation

    def add_steps(
        self,
        step: Sequence[int],
        samples: Sequence[int],
        wall_time: Sequence[float],
        dropped: Sequence[bool | None] | None = None,
    ) -> None:
        """Step rows (as the metrics columns); rows whose `dropped` is True (late or duplicate gradients) did
        no training."""
        steps = np.asarray(step, dtype=np.int64)
        if not len(steps):
            return
        counts = np.asarray(samples, dtype=np.float64)
        ends = np.asarray(wall_time, dtype=np.float64)
        if dropped is not None:
            keep = np.array([d is not True for d in dropped], dtype=bool)
            steps, counts, ends = steps[keep], counts[keep], ends[keep]
            if not len(steps):
                return
        size = int(steps.max()) + 1
        if size > len(self._end):  # grow by doubling: rows keep arriving for later steps
            grown = max(size, 2 * len(self._end))
            self._samples = np.concatenate([self._samples, np.zeros(grown - len(self._samples))])
            self._end = np.concatenate([self._end, np.full(grown - len(self._end), np.nan)])
        np.add.at(self._samples, steps, counts)
        np.fmax.at(self._end, steps, ends)  # fmax: a NaN (no row yet) gives way to the row's time

    def add_eval(self, wall_time: float, eval_s: float | None) -> None:
        if eval_s is not None and not math.isnan(eval_s):
            self._pauses.append((wall_time, eval_s))

    def add_columns(self, columns: dict[str, Sequence[Any]]) -> None:
        """Rows as `MetricsSink.rows()` gives them (step and evaluation rows, told apart by `kind`)."""
        kinds = list(columns.get("kind", []))
        rows = [i for i, k in enumerate(kinds) if k == "step"]
        dropped = columns.get("dropped")
        self.add_steps(
            [columns["step"][i] for i in rows],
            [columns["samples"][i] for i in rows],
            [columns["wall_time"][i] for i in rows],
            [dropped[i] for i in rows] if dropped is not None else None,
        )
        for i, kind in enumerate(kinds):
            if kind == "eval":
                self.add_eval(columns["wall_time"][i], columns["eval_s"][i])

    def samples_per_s(self) -> float | None:
        """The figure over the rows so far; None before two global steps have rows."""
        present = np.flatnonzero(~np.isnan(self._end))
        n = len(present)
        if n < 2:
            return None
        skip = min(max(1, int(n * WARMUP_FRACTION)), n - 1)
        t_start = float(self._end[present[skip - 1]])
        t_end = float(self._end[present[-1]])
        paused = sum(seconds for at, seconds in self._pauses if t_start < at <= t_end)
        elapsed = t_end - t_start - paused
        return float(self._samples[present[skip:]].sum() / elapsed) if elapsed > 0 else None
