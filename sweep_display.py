"""What `distrain tune` shows: a live table of trials on a terminal (one line per event otherwise, for
logs and CI), then the results sorted by the objective. Knows neither Ray nor torch: it reads the
sweep's events by their fields and the results as a DataFrame."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

RESULT_COLUMNS = (
    ("trial_id", "trial", ""),
    ("status", "status", ""),
    ("final_accuracy", "final acc", ".4f"),
    ("time_to_target_s", "time to target (s)", ".1f"),
    ("samples_per_s", "samples/s", ",.0f"),
    ("epochs_completed", "epochs", "d"),
)


def _params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


class SweepDisplay:
    def __init__(self, console: Console, num_trials: int, header: str) -> None:
        self.console = console
        self.header = header
        self.num_trials = num_trials
        self.live_mode = console.is_terminal
        self.rows: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        self.live: Live | None = None

    def __enter__(self) -> SweepDisplay:
        return self  # the live table starts with the sweep (SweepStarted), not before its checks

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.refresh()
            self.live.__exit__(*exc)

    def _table(self) -> Table:
        done = sum(r["status"] in ("completed", "stopped", "error") for r in self.rows.values())
        title = f"trials {done}/{self.num_trials} done, {time.time() - self.started:.0f} s"
        table = Table(title=Text(title))
        for name in ("trial", "config", "status", "epoch", "test acc", "test loss", "elapsed (s)"):
            table.add_column(
                name, justify="right" if name in ("epoch", "test acc", "test loss", "elapsed (s)") else "left"
            )
        for trial_id, r in self.rows.items():
            table.add_row(
                trial_id,
                r["params"],
                r["status"],
                r["epoch"],
                r["acc"],
                r["loss"],
                r["elapsed"],
            )
        return table

    def _say(self, text: str) -> None:
        if self.live is not None:
            self.live.refresh()
        else:
            self.console.print(text, markup=False, highlight=False)

    def on_event(self, event: Any) -> None:
        kind = type(event).__name__
        if kind == "SweepStarted":  # printed once the sweep is known to fit the cluster
            self.console.print(
                f"{self.header}  |  cluster {event.cluster_cpus:g} CPUs, up to {event.largest_trial_cpus:g} per trial",
                markup=False,
                highlight=False,
            )
            if self.live_mode:
                # get_renderable: the table is rebuilt on every refresh, so the elapsed time keeps ticking
                self.live = Live(console=self.console, get_renderable=self._table, refresh_per_second=2)
                self.live.__enter__()
        elif kind == "TrialStarted":
            params = _params_text(event.params)
            self.rows[event.trial_id] = dict(params=params, status="running", epoch="-", acc="-", loss="-", elapsed="-")
            self._say(f"trial {event.trial_id} started ({event.cpus:g} CPUs): {params}")
        elif kind == "TrialEpoch":
            row = self.rows.setdefault(event.trial_id, dict(params="", status="running"))
            row.update(
                epoch=f"{event.epoch}/{event.epochs}",
                acc=f"{event.test_accuracy:.4f}",
                loss=f"{event.test_loss:.4f}",
                elapsed=f"{event.elapsed_s:.1f}",
            )
            self._say(
                f"trial {event.trial_id} epoch {event.epoch}/{event.epochs}  test acc {event.test_accuracy:.4f}"
                f"  test loss {event.test_loss:.4f}  {event.elapsed_s:.1f} s"
            )
        elif kind == "TrialEnded":
            row = self.rows.setdefault(event.trial_id, dict(params="", epoch="-", acc="-", loss="-", elapsed="-"))
            row["status"] = event.status
            extra = f" ({event.error})" if event.error else ""
            self._say(f"trial {event.trial_id} {event.status}{extra}")


def _cell(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if spec == "d":
        return str(int(value))
    return format(value, spec) if spec else str(value)


def results_table(results: Any, swept: list[str], title: str) -> Table:
    """The sweep's results (already sorted by the objective) with the swept columns first."""
    table = Table(title=Text(title))
    config_columns = [c for c in swept if c in results.columns]
    for name in config_columns:
        table.add_column(name, justify="right")
    for _, label, _ in RESULT_COLUMNS:
        table.add_column(label, justify="left" if label in ("trial", "status") else "right")
    for _, row in results.iterrows():
        cells = [_cell(row[c], "g" if isinstance(row[c], float) else "") for c in config_columns]
        cells += [_cell(row[key], spec) for key, _, spec in RESULT_COLUMNS]
        table.add_row(*cells)
    return table


def print_table(console: Console, table: Table) -> None:
    """On a terminal as is; in logs and pipes at the table's natural width (nothing wraps there)."""
    if not console.is_terminal:
        natural = console.measure(table, options=console.options.update_width(1_000)).maximum
        console = Console(file=console.file, width=max(console.width, natural), soft_wrap=True)
    console.print(table)
