"""`distrain tune`'s display without Ray: the time-left estimate from the trials that ended."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import pytest
from rich.console import Console

from distrain.sweep_display import SweepDisplay, format_left, time_left


@dataclass
class TrialStarted:  # the display reads events by their class name and fields
    trial_id: str
    params: dict = field(default_factory=dict)
    cpus: float = 1.0


@dataclass
class TrialEnded:
    trial_id: str
    status: str = "completed"
    error: str = ""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_left_is_mean_trial_time_times_remaining_over_concurrency():
    assert time_left([], [5.0], 10, 2) is None  # nothing ended yet: no estimate
    assert time_left([60.0, 120.0], [], 4, 2) == pytest.approx(90.0 * 4 / 2)
    # a running trial counts what it lacks of the mean; one past the mean counts nothing
    assert time_left([100.0], [30.0, 150.0], 1, 3) == pytest.approx((100.0 + 70.0) / 3)
    assert [format_left(s) for s in (40, 600, 3 * 3600)] == ["~40 s left", "~10 min left", "~3.0 h left"]


def test_display_prints_the_estimate_after_the_first_trials_end():
    """Six trials, two at a time, each 60 s: after the first two end, four remain = two rounds = 2 min."""
    text = io.StringIO()
    clock = Clock()
    display = SweepDisplay(Console(file=text, width=200), num_trials=6, clock=clock)
    display.on_event(TrialStarted("a"))
    display.on_event(TrialStarted("b"))
    assert display.estimate() == ""  # no trial has ended
    clock.now = 60.0
    display.on_event(TrialEnded("a"))
    display.on_event(TrialEnded("b"))
    assert "trial b completed  |  2/6 done, ~2 min left" in text.getvalue()
    display.on_event(TrialStarted("c"))
    clock.now = 90.0  # c is half done: 4 trials of work less its 30 s, two at a time
    assert display.estimate() == format_left((60 * 3 + 30) / 2)
    display.on_event(TrialEnded("c", "error", "boom"))  # a failed trial's time is no trial's duration
    assert display.durations == [60.0, 60.0]


def test_the_estimate_never_exceeds_the_time_budget():
    clock = Clock()
    display = SweepDisplay(Console(file=io.StringIO()), num_trials=100, time_budget_s=300, clock=clock)
    display.on_event(TrialStarted("a"))
    clock.now = 100.0
    display.on_event(TrialEnded("a"))
    assert display.estimate() == format_left(200)  # not 99 x 100 s: the budget stops the sweep first
