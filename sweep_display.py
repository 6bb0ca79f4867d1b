"""What `distrain tune` shows: a live table of trials on a terminal (one line per event otherwise, for
logs and CI), then the results sorted by the objective. Knows neither Ray nor torch: it reads the
sweep's events by their fields and the results as a DataFrame."""

from __future__ import annotations

import io
import math
import textwrap
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

RESULT_COLUMNS = (
    ("trial_id", "trial", ""),
    ("status", "status", ""),
    ("final_accuracy", "final val acc", ".4f"),
    ("test_accuracy", "test acc", ".4f"),
    ("time_to_target_s", "time to target (s)", ".1f"),
    ("samples_per_s", "samples/s", ",.0f"),
    ("epochs_completed", "epochs", "d"),
)


def _params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def time_left(durations: list[float], running: list[float], pending: int, concurrency: int) -> float | None:
    """Seconds until the sweep ends, from the trials that ended: each trial not started yet takes the
    mean duration, each running one what it lacks of the mean (it has run `elapsed`), and `concurrency`
    trials run at once. None before any trial ended."""
    if not durations:
        return None
    mean = sum(durations) / len(durations)
    work = mean * pending + sum(max(mean - elapsed, 0.0) for elapsed in running)
    return work / max(concurrency, 1)


def format_left(seconds: float) -> str:
    if seconds < 90:
        return f"~{seconds:.0f} s left"
    if seconds < 120 * 60:
        return f"~{seconds / 60:.0f} min left"
    return f"~{seconds / 3600:.1f} h left"


class SweepDisplay:
    def __init__(
        self, console: Console, num_trials: int, time_budget_s: float = 0.0, clock: Any = time.monotonic
    ) -> None:
        self.console = console
        self.num_trials = num_trials
        self.time_budget_s = time_budget_s  # 0: none; the estimate never exceeds what is left of it
        self.clock = clock
        self.live_mode = console.is_terminal
        self.rows: dict[str, dict[str, Any]] = {}
        self.started = clock()
        self.sweep_started = self.started  # reset when Tune starts (after Ray and the checks)
        self.live: Live | None = None
        self.trial_started: dict[str, float] = {}  # running trials' start times
        self.durations: list[float] = []  # trials that completed or were stopped (not errors: too quick)
        self.concurrency = 1  # the most trials seen running at once

    def done(self) -> int:
        return sum(r["status"] in ("completed", "stopped", "error") for r in self.rows.values())

    def estimate(self) -> str:
        """'~N min left' once a trial has ended (and until the last one has), else ''."""
        now = self.clock()
        done = self.done()
        if done >= self.num_trials:
            return ""
        running = [now - t for t in self.trial_started.values()]
        pending = max(self.num_trials - done - len(running), 0)
        left = time_left(self.durations, running, pending, self.concurrency)
        if left is None:
            return ""
        if self.time_budget_s:
            left = min(left, max(self.time_budget_s - (now - self.sweep_started), 0.0))
        return format_left(left)

    def __enter__(self) -> SweepDisplay:
        return self  # the live table starts with the sweep (SweepStarted), not before its checks

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.refresh()
            self.live.__exit__(*exc)

    def _table(self) -> Table:
        left = self.estimate()
        title = f"trials {self.done()}/{self.num_trials} done, {self.clock() - self.started:.0f} s"
        title += f", {left}" if left else ""
        rows = [
            (trial_id, r["params"], r["status"], r["epoch"], r["acc"], r["loss"], r["elapsed"])
            for trial_id, r in self.rows.items()
        ]
        return fitted_table(title, ["trial", "config", "status", "epoch", "val acc", "val loss", "elapsed (s)"], rows)

    def _say(self, text: str) -> None:
        if self.live is not None:
            self.live.refresh()
        else:
            self.console.print(text, markup=False, highlight=False)

    def on_event(self, event: Any) -> None:
        kind = type(event).__name__
        if kind == "SweepStarted":  # printed once the sweep is known to fit the cluster
            self.sweep_started = self.clock()
            self.console.print(
                f"cluster {event.cluster_cpus:g} CPUs, up to {event.largest_trial_cpus:g} per trial",
                markup=False,
                highlight=False,
            )
            if self.live_mode:
                # get_renderable: the table is rebuilt on every refresh, so the elapsed time keeps ticking
                self.live = Live(console=self.console, get_renderable=self._table, refresh_per_second=2)
                self.live.__enter__()
        elif kind == "TrialStarted":
            params = _params_text(event.params)
            self.trial_started[event.trial_id] = self.clock()
            self.concurrency = max(self.concurrency, len(self.trial_started))
            self.rows[event.trial_id] = dict(params=params, status="running", epoch="-", acc="-", loss="-", elapsed="-")
            self._say(f"trial {event.trial_id} started ({event.cpus:g} CPUs): {params}")
        elif kind == "TrialEpoch":
            row = self.rows.setdefault(event.trial_id, dict(params="", status="running"))
            # classification shows its accuracy; another task the sweep's metric (its target's)
            metric = getattr(event, "metric", "val_accuracy")
            accuracy = metric in ("val_accuracy", "test_accuracy")
            shown = event.val_accuracy if metric == "val_accuracy" else getattr(event, "value", math.nan)
            label = metric.replace("_accuracy", " acc").replace("_", " ")
            text = f"{shown:.4f}" if accuracy else f"{shown:.4g}"
            row.update(
                epoch=f"{event.epoch}/{event.epochs}",
                acc=text,
                loss=f"{event.val_loss:.4f}",
                elapsed=f"{event.elapsed_s:.1f}",
            )
            figures = f"{label} {text}" + ("" if metric == "val_loss" else f"  val loss {event.val_loss:.4f}")
            self._say(f"trial {event.trial_id} epoch {event.epoch}/{event.epochs}  {figures}  {event.elapsed_s:.1f} s")
        elif kind == "TrialEnded":
            row = self.rows.setdefault(event.trial_id, dict(params="", epoch="-", acc="-", loss="-", elapsed="-"))
            row["status"] = event.status
            started = self.trial_started.pop(event.trial_id, None)
            if started is not None and event.status != "error":
                self.durations.append(self.clock() - started)
            extra = f" ({event.error})" if event.error else ""
            left = self.estimate()
            progress = f"{self.done()}/{self.num_trials} done" + (f", {left}" if left else "")
            self._say(f"trial {event.trial_id} {event.status}{extra}  |  {progress}")


def _cell(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if spec == "d":
        return str(int(value))
    return format(value, spec) if spec else str(value)


# Tables at any width (80 columns included): the trial id, the status and every figure are never
# cut; the config is the one column that gives way, its `key=value` items stacked one under another
# (an item longer than the whole column folds, still whole); headers of figures break at their spaces.
UNCUT = ("trial", "status")


def fitted_table(title: str, headers: list[str], rows: list[tuple[str, ...]]) -> Table:
    """A table whose only wrapping column is `config` (if any): every other column is as wide as its
    widest cell (its header broken at spaces to that width), so rich narrows the config alone."""
    # No vertical rules, no outer edge, one padding between columns: at 80 columns every char counts.
    table = Table(title=Text(title), box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, pad_edge=False)
    for i, name in enumerate(headers):
        cells = [str(row[i]) for row in rows]
        if name == "config":
            table.add_column(name, overflow="fold")
            continue
        width = max([len(c) for c in cells] + [len(word) for word in name.split()])
        header = name if name in UNCUT else "\n".join(textwrap.wrap(name, width)) or name
        table.add_column(header, justify="left" if name in UNCUT else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def results_table(results: Any, swept: list[str], title: str, width: int | None = None) -> Table:
    """The sweep's results (already sorted by the objective): the swept values first, a column each, or
    (where that would not fit `width` columns) stacked in one `config` column after the trial id."""
    config_columns = [c for c in swept if c in results.columns]
    columns = list(RESULT_COLUMNS)
    metric = results["metric"].iloc[0] if "metric" in results.columns and len(results) else "val_accuracy"
    if metric not in ("val_accuracy", "test_accuracy"):  # another task's sweep: its target metric's final values
        name = metric.split("_", 1)[1]
        columns[2] = ("final_metric", f"final {metric.replace('_', ' ')}", ".4g")
        columns[3] = ("test_metric", f"test {name.replace('_', ' ')}", ".4g")
    configs, figures = [], []
    for _, row in results.iterrows():
        configs.append([_cell(row[c], "g" if isinstance(row[c], float) else "") for c in config_columns])
        figures.append([_cell(row.get(key), spec) for key, _, spec in columns])  # a sweep's before: no test_*
    labels = [label for _, label, _ in columns]
    wide = fitted_table(title, config_columns + labels, [tuple(c + f) for c, f in zip(configs, figures, strict=True)])
    if width is None or _min_width(wide) <= width:
        return wide
    items = [f"{name}={value}" for c in configs for name, value in zip(config_columns, c, strict=True)]
    if _min_width(fitted_table(title, labels, figures)) + 1 + max(map(len, items), default=0) > width:
        # Still too narrow for a config item a line: the test set's column gives way (results.csv keeps it).
        keep = [i for i, (key, _, _) in enumerate(columns) if not key.startswith("test_")]
        labels, figures = [labels[i] for i in keep], [[f[i] for i in keep] for f in figures]
    stacked = [
        (f[0], " ".join(f"{name}={value}" for name, value in zip(config_columns, c, strict=True)), *f[1:])
        for c, f in zip(configs, figures, strict=True)
    ]
    return fitted_table(title, [labels[0], "config", *labels[1:]], stacked)


def _min_width(table: Table) -> int:
    console = Console(file=io.StringIO(), width=10_000)
    return console.measure(table).minimum


def print_table(console: Console, table: Table) -> None:
    """On a terminal as is; in logs and pipes at the table's natural width (nothing wraps there)."""
    if not console.is_terminal:
        natural = console.measure(table, options=console.options.update_width(1_000)).maximum
        console = Console(file=console.file, width=max(console.width, natural), soft_wrap=True)
    console.print(table)
