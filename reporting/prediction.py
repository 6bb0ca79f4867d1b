"""`distrain report`: the planner's predicted step time against the one measured, for runs that carry a
prediction (`--strategy auto` writes prediction.json next to the run's metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from distrain.orchestrator.auto_choice import recorded_choice
from distrain.planning.calibrate import steady_figures_of
from distrain.reporting.markdown import markdown_table

if TYPE_CHECKING:
    from distrain.reporting.report import Run

COLUMNS = ["run", "strategy", "predicted step ms", "measured step ms", "error"]


def prediction_rows(runs: Sequence[Run]) -> list[list[str]]:
    rows = []
    for run in runs:
        choice = recorded_choice(run.path)
        if choice is None:
            continue
        predicted = float(choice["predicted"]["step_s"])
        try:
            measured = float(steady_figures_of(run.metrics, run.source)["step_s"])
        except (ValueError, KeyError):  # too short a run to have a steady state
            rows.append([run.label, choice["strategy"], f"{predicted * 1e3:.2f}", "-", "-"])
            continue
        error = predicted / measured - 1 if measured else float("nan")
        rows.append([run.label, choice["strategy"], f"{predicted * 1e3:.2f}", f"{measured * 1e3:.2f}", f"{error:+.0%}"])
    return rows


def prediction_section(runs: Sequence[Run]) -> str:
    rows = prediction_rows(runs)
    if not rows:
        return ""
    return (
        "## Predicted against measured\n\nThe planner's step time (per worker, steady state) for runs started "
        "with `--strategy auto`, against the measured one.\n\n" + markdown_table(rows, COLUMNS) + "\n"
    )
