"""`distrain tune`'s display without Ray: the time-left estimate from the trials that ended, and the
tables at 80 columns."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import pandas as pd
import pytest
from rich.console import Console

from distrain.sweep_display import SweepDisplay, format_left, print_table, results_table, time_left


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


# ---------------------------------------------------------------- 80 columns
@dataclass
class TrialEpoch:
    trial_id: str
    epoch: int
    epochs: int
    val_accuracy: float
    val_loss: float
    elapsed_s: float


# What a sweep over batch size, LR scaling, warmup and a random learning rate looks like (Tune's ids:
# the experiment's hash, then the trial's number).
CONFIGS = [
    {"batch_size": 16, "lr_scaling": "linear", "warmup_epochs": 0, "lr": 0.0123457, "strategy": "local-sgd"},
    {"batch_size": 32, "lr_scaling": "sqrt", "warmup_epochs": 1, "lr": 0.0456789, "strategy": "bsp"},
    {"batch_size": 128, "lr_scaling": "none", "warmup_epochs": 1, "lr": 0.3, "strategy": "ssp"},
]
IDS = [f"bf5d2_{i:05d}" for i in range(len(CONFIGS))]
STATUSES = ["completed", "stopped", "error"]


def rendered(table, width: int = 80) -> str:
    text = io.StringIO()
    Console(file=text, width=width, color_system=None).print(table)
    return text.getvalue()


def assert_nothing_cut(text: str, configs: list[dict]) -> None:
    assert "…" not in text, text
    words = text.split()  # a config item stacked under another is still one word
    for trial_id, status, config in zip(IDS, STATUSES, configs, strict=True):
        assert trial_id in words and status in words, text
        for name, value in config.items():
            item = f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
            assert item in words, (item, text)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80


def test_the_live_table_at_80_columns_cuts_no_trial_id_status_or_config():
    """It showed `bf5d2_00…`, `compl…` and `batch_si…`: now the config is the column that gives way,
    its items stacked, while ids, statuses and figures keep their width."""
    display = SweepDisplay(Console(file=io.StringIO(), width=80), num_trials=3, clock=Clock())
    for trial_id, status, config in zip(IDS, STATUSES, CONFIGS, strict=True):
        display.on_event(TrialStarted(trial_id, config, 2.01))
        display.on_event(TrialEpoch(trial_id, 3, 12, 0.9123, 0.2345, 31.6))
        display.on_event(TrialEnded(trial_id, status))
    text = rendered(display._table())
    assert_nothing_cut(text, CONFIGS)
    assert "batch_size=16 lr_scaling=linear" not in text  # stacked, an item a line


def results() -> pd.DataFrame:
    rows = [
        dict(
            trial_id=i, status=s, final_accuracy=0.95, test_accuracy=0.9412, time_to_target_s=12.3,
            samples_per_s=4346.1, epochs_completed=12,
        )
        | config
        for i, s, config in zip(IDS, STATUSES, CONFIGS, strict=True)
    ]
    return pd.DataFrame(rows).assign(metric="val_accuracy")


def test_the_results_table_at_80_columns_stacks_the_config_and_cuts_nothing():
    swept = list(CONFIGS[0])
    narrow = io.StringIO()
    print_table(Console(file=narrow, width=80, force_terminal=True, color_system=None),
                results_table(results(), swept, "distrain tune: 3 trial(s)", width=80))  # fmt: skip
    assert_nothing_cut(narrow.getvalue(), CONFIGS)
    wide = rendered(results_table(results(), swept, "distrain tune: 3 trial(s)", width=200), width=200)
    assert all(name in wide.split() for name in swept)  # a column each where they fit
    assert "config" not in wide.split()
    assert "0.9500" in wide and "0.9412" in wide  # the validation figure the sweep selects on, the test one apart
