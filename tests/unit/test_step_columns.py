"""Strategy column families (strategies/step_columns.py) and report declarations (Strategy.settings_text,
`described_options`): metrics, summary and report carry what a strategy declares, without naming it. No Ray."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pyarrow as pa

from distrain.orchestrator import summary
from distrain.orchestrator.metrics import SCHEMA
from distrain.reporting import report
from distrain.reporting.plots import PlotRun, column_plot
from distrain.strategies.base import ColumnPlot, StepColumns, Strategy
from distrain.strategies.step_columns import STEP_COLUMN_FAMILIES

SPIN = StepColumns(
    {"spin": "int64"},
    key="spin",
    figures=lambda rows: {"spin_max": int(rows["spin"].max())},
    report_column=("spin max", "spin_max", "d"),
    plots=(ColumnPlot("spin.png", "spin", "over_time", "Spin", "spin", "Spin over time."),),
)


def steps(**columns) -> pd.DataFrame:
    n = len(next(iter(columns.values())))
    base = {"kind": ["step"] * n, "step": list(range(n)), "wall_time": [float(i) for i in range(n)], "worker": [0] * n}
    return pd.DataFrame(base | columns)


def test_every_familys_columns_are_in_the_schema_with_their_types():
    for family in STEP_COLUMN_FAMILIES:
        for name, kind in family.columns.items():
            assert SCHEMA.field(name).type == pa.type_for_alias(kind), name


def test_a_familys_figures_come_only_from_runs_that_have_its_rows(monkeypatch):
    monkeypatch.setattr(summary, "STEP_COLUMN_FAMILIES", (SPIN,))
    assert summary.family_figures(steps(spin=[1, 3, None])) == {"spin_max": 3}
    assert summary.family_figures(steps(spin=[None, None])) == {}  # the column, but no row of the family
    assert summary.family_figures(steps(loss=[0.1])) == {}  # a run without the column at all


def test_the_built_in_families_give_the_figures_of_earlier_versions():
    ps = summary.family_figures(steps(staleness=[0, 2], wait_s=[0.5, 0.5], bytes_sent=[8, 8], bytes_received=[4, 4]))
    assert ps["staleness_max"] == 2 and ps["wait_s_total"] == 1.0 and ps["bytes_pulled_per_step"] == 4.0
    local = summary.family_figures(steps(tau=[2, 2, 4], averaging_round=[0, 1, 1], bytes_sent=[0, 10, 0]))
    assert local["tau_changes"] == [[0, 2], [2, 4]] and local["averaging_rounds"] == 1
    assert "staleness_max" not in local


def test_a_declared_over_time_plot_draws_only_when_the_value_changed():
    draw = column_plot(SPIN.plots[0])
    assert draw.__name__ == "plot_spin"

    def run(values):
        return PlotRun("r", "r", "C0", steps(spin=values), {})

    assert draw([run([1, 1, 1])]) is None
    assert draw([run([1, 2, 2])]) is not None
    assert column_plot(dataclasses.replace(SPIN.plots[0], kind="histogram"))([run([1, 1, 1])]) is not None


def test_strategy_text_is_made_of_the_strategy_s_own_declarations(monkeypatch):
    class Spinner(Strategy):
        name = "spinner"
        transports = ("ps",)

        @classmethod
        def settings_text(cls, config):
            return f" spin={config['spin']}"

        @classmethod
        def run_settings_text(cls, config):
            return " fast" if config.get("fast") else ""

    monkeypatch.setattr(report, "strategy_class", lambda name: Spinner)
    assert report.strategy_text({"strategy": "spinner", "spin": 3, "transport": "ps", "fast": True}) == (
        "spinner spin=3 (ps) fast"
    )
    # a phase of a schedule: its own settings and default transport, never the run's end settings
    assert report.strategy_text({"spin": 1, "fast": True}, "spinner") == "spinner spin=1 (ps)"


def test_a_strategy_the_report_cannot_import_is_shown_by_its_name():
    assert report.strategy_text({"strategy": "gone.py:Old", "transport": "collective"}) == "gone.py:Old"


def test_settings_the_strategy_column_states_are_the_strategies_declared_options():
    # the set earlier versions listed by hand, now each built-in strategy's `described_options`
    assert report.shown_with_strategy() == {
        "strategy", "schedule", "transport", "ps_shards", "staleness", "staleness_lr", "backup_workers",
        "backup_tasks", "portions", "tau", "adaptive_tau", "tau_interval", "tau_max", "sync_every",
        "outer_optimizer", "outer_lr", "outer_momentum", "fragments", "overlap_steps", "mix_alpha", "compress",
    }  # fmt: skip


def test_bsp_keeps_books_of_its_own_only_with_backup_workers_or_tasks():
    from distrain.config import RunConfig
    from distrain.strategies.bsp import BSP
    from distrain.strategies.ps import SSP

    def books(cls, **kw):
        return cls.keeps_own_books(RunConfig(**kw))

    assert books(BSP, strategy="bsp", transport="ps", backup_workers=1, workers=3)
    assert books(BSP, strategy="bsp", transport="ps", backup_tasks=True, workers=3)
    assert not books(BSP, strategy="bsp", transport="ps", workers=3)
    assert not books(SSP, strategy="ssp")  # the base class: no books of its own


def test_the_closing_table_rows_come_from_the_families_in_their_places():
    from distrain.commands.run_summary import _family_rows

    ps = {"staleness_p50": 1.0, "staleness_p95": 2.0, "staleness_max": 3, "wait_s_total": 0.5,
          "bytes_pushed_per_step": 1000.0, "bytes_pulled_per_step": 2000.0, "staleness_lr": True}  # fmt: skip
    rows = dict(_family_rows(ps, "traffic"))
    assert rows["staleness p50 / p95 / max"] == "1 / 2 / 3" and rows["time blocked (all workers)"] == "0.50 s"
    assert rows["staleness-aware rate (lr / staleness)"] == "on"
    assert _family_rows(ps, "end") == []  # local SGD's rows go at the end, and this run has none
    local = {"averaging_rounds": 4, "bytes_communicated": 10, "tau_min": 2, "tau_max": 8, "tau_final": 8}
    assert _family_rows(local, "end")[-1] == ("tau min / max / final", "2 / 8 / 8")
    assert _family_rows(local, "traffic") == [] and _family_rows({}, "end") == []


def test_each_family_column_is_read_from_a_comm_stats_field_and_tau_keeps_its_name():
    """The step rows' "tau" column (local SGD's period, DiLoCo's H) is CommStats.period: the option's name
    stays local SGD's, the column's name stays what metrics.parquet has always held."""
    from distrain.strategies.base import CommStats
    from distrain.strategies.step_columns import family_columns, family_fields

    fields = family_fields()
    assert list(fields) == list(family_columns())  # the schema's columns, in its order
    assert fields["tau"] == "period" and fields["staleness"] == "lag" and fields["clock"] == "clock"
    stats = CommStats(period=4, averaging_round=2)
    row = {column: getattr(stats, name) for column, name in fields.items()}
    assert row["tau"] == 4 and row["averaging_round"] == 2 and "tau" in SCHEMA.names
