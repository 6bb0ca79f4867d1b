"""The calibration's figures from metrics rows (no Ray): what a never-averaging run's window leaves out,
and which dispersion a synchronous round waits for."""

from __future__ import annotations

import pandas as pd
import pytest

from distrain.planning.calibrate import round_spread, steady_figures_of
from distrain.planning.planner import expected_max


def _rows(compute: dict[int, list[float]], comm: dict[tuple[int, int], float] | None = None) -> pd.DataFrame:
    """Step rows of workers stepping back to back: each step lasts its compute plus its comm."""
    rows = []
    for w, times in compute.items():
        t = 0.0
        for i, c in enumerate(times):
            extra = (comm or {}).get((w, i), 0.0)
            t += c + extra
            rows.append({"kind": "step", "worker": w, "step": i, "wall_time": t, "compute_s": c, "comm_s": extra,
                         "wait_s": 0.0})  # fmt: skip
    return pd.DataFrame(rows)


def test_a_never_averaging_run_leaves_its_one_average_out_of_the_step():
    # 40 steps of 10 ms on two workers; one average of 200 ms at step 30 (the epoch end: the group's first call)
    df = _rows({0: [0.01] * 40, 1: [0.01] * 40}, {(0, 30): 0.2, (1, 30): 0.2})
    with_it = steady_figures_of(df)["step_s"]
    assert with_it == pytest.approx(0.01 + 0.2 / 29)  # the window (steps 10..39) spreads it over 29 steps
    assert steady_figures_of(df, without_sync=True)["step_s"] == pytest.approx(0.01)


def test_round_spread_ignores_a_burst_that_slows_every_worker_at_once():
    # both workers 10 ms, except steps where other load slows both 3x together: a round waits for nobody
    common = [0.03 if i % 5 == 0 else 0.01 for i in range(40)]
    df = _rows({0: common, 1: list(common)})
    pooled = steady_figures_of(df)["spread"]
    assert expected_max(pooled, 4) > 1.5  # over time the steps vary 3x
    assert round_spread(df) == [pytest.approx(1.0)] * len(round_spread(df))
    assert expected_max(round_spread(df), 4) == pytest.approx(1.0)
    # one worker 20% slower than the other in every round: that is what a round waits for
    df = _rows({0: [0.01] * 40, 1: [0.012] * 40})
    spread = round_spread(df)
    assert min(spread) == pytest.approx(0.01 / 0.011) and max(spread) == pytest.approx(0.012 / 0.011)
    assert round_spread(_rows({0: [0.01] * 40})) == []  # one worker: no rounds to compare within


def test_a_stretch_within_the_single_workers_noise_is_no_contention():
    from distrain.planning.calibrate import contention_slope

    assert contention_slope(1.05, [0.010, 0.0104, 0.0098]) == (0.0, pytest.approx(0.06))  # 6% noise: none
    assert contention_slope(1.5, [0.010, 0.0104, 0.0098])[0] == pytest.approx(0.5)  # well past it: measured
    assert contention_slope(1.06, [0.010])[0] == pytest.approx(0.06)  # one repeat: no noise figure
    assert contention_slope(0.9, [0.010, 0.010])[0] == 0.0
