"""What a strategy declares about its per-step columns and its planning, as plain data: the report, the
summary and the planner read these instead of naming a strategy's columns or options. Apart from
strategies/base.py (which re-exports them as part of the contract) so that the modules declaring them
(strategies/consistency.py, adacomm.py) need not import the contract, which imports their users."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PlanningSetting:
    """One option of a strategy that the planner's step-time model sets (planning/planner.py), by its role
    in the model: "period" (steps between synchronisations: local SGD's τ, DiLoCo's H), "bound" (clocks a
    worker may run ahead: SSP's s) or "backups" (workers beyond those a round waits for: k-of-n)."""

    option: str
    role: str
    default: int  # what `distrain run` gives it


@dataclass(frozen=True)
class ColumnPlot:
    """A report plot of one step column, drawn by the report's generic drawers (reporting/plots.py):
    "histogram" (each run's share of steps per integer value) or "over_time" (the value over wall time,
    drawn only when some run's value changed)."""

    file: str  # e.g. "staleness_hist.png"
    column: str
    kind: str  # "histogram" | "over_time"
    title: str
    axis_label: str  # the value's axis: x of a histogram, y of a plot over time
    caption: str


@dataclass(frozen=True)
class StepColumns:
    """A family of per-step columns that a kind of strategy fills through `CommStats` (the parameter
    server's, local SGD's), with what the run's records make of them. Declared once, by the strategies'
    module that owns the columns (strategies/step_columns.py lists them); metrics.parquet, summary.json
    and the report carry them without naming a column or an option."""

    columns: dict[str, str]  # name -> Arrow type, in the schema's order
    # A column filled from a `CommStats` field of another name (local SGD's "tau" column holds the
    # period, which DiLoCo's H fills too): column -> field; the others are the fields of their names.
    fields: dict[str, str] = field(default_factory=dict)
    key: str = ""  # the column whose non-null rows are this family's; "" : no figures
    # summary.json's figures from those rows (a DataFrame of the step rows that have `key`, never empty)
    figures: Callable[[Any], dict[str, Any]] | None = None
    report_column: tuple[str, str, str] | None = None  # the report table's (header, summary key, format)
    plots: tuple[ColumnPlot, ...] = ()
    # `distrain run`'s closing table: (label, value) rows from summary.json ([] where its keys are absent),
    # placed after the run's traffic rows ("traffic") or at the end, before the schedule's ("end")
    closing_rows: Callable[[dict[str, Any]], list[tuple[str, str]]] | None = None
    closing_place: str = "traffic"
