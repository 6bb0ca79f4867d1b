"""The PNG plots of `distrain report`: one function per plot, each returning a figure or None (no data).

Every plot against time draws each run's points in wall-time order (never by step: an asynchronous
run's steps finish out of order, and a run that recovered from a failure redoes steps later), breaks
its line at each failure and strategy switch, marks both, and shades the time until training
resumed, so a line never runs backwards in time and nothing that happened to a run is hidden. Figures are Agg
canvases (`matplotlib.figure.Figure`, never pyplot): no display, no global backend touched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from distrain.strategies.declarations import ColumnPlot
from distrain.strategies.step_columns import STEP_COLUMN_FAMILIES

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGSIZE, DPI = (8.0, 5.0), 100  # every plot is 800 x 500 px
# Each run's clock starts at its first step (report.plot_run shifts it): start-up time, which differs per
# run and machine load, would otherwise push the curves into the last seconds of a shared axis.
WALL = "seconds since the run's first step"
SPLIT_COLORS = {"compute": "#4c72b0", "communication": "#dd8452", "wait": "#c44e52"}


@dataclass
class Failure:
    wall_time: float  # when the loss was seen
    resumed_at: float | None  # the first step row after it (None: the run never trained again)
    text: str


@dataclass
class Switch:
    wall_time: float  # the first step row of the new phase
    step: int
    strategy: str  # the new phase's strategy, as the report describes it


@dataclass
class PlotRun:
    """One run as the plots see it: its metrics, colour, legend text and what happened to it."""

    label: str
    legend: str  # label, strategy and key settings
    color: str
    metrics: pd.DataFrame  # wall_time: seconds since the run's first step (`origin`)
    summary: dict[str, Any]
    phases: list[tuple[int, int, str]] = field(default_factory=list)  # [start, end) steps, strategy text
    failures: list[Failure] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)
    origin: float = 0.0  # the first step's wall time since the run started: the plots' zero

    def steps(self, column: str) -> pd.DataFrame:
        """Its step rows where `column` is set, in wall-time order."""
        df = self.metrics
        if column not in df:
            return df.iloc[0:0]
        return df[(df["kind"] == "step") & df[column].notna()].sort_values("wall_time", kind="stable")

    @property
    def accuracy(self) -> str:
        """The accuracy column its curves draw: the validation split's, which every evaluation scores (the
        test set is scored at the end); a run recorded before the validation split: the test set's."""
        df = self.metrics
        return "val_accuracy" if "val_accuracy" in df and df["val_accuracy"].notna().any() else "test_accuracy"

    def evals(self) -> pd.DataFrame:
        df, column = self.metrics, self.accuracy
        if column not in df:
            return df.iloc[0:0]
        return df[(df["kind"] == "eval") & df[column].notna()].sort_values("wall_time", kind="stable")


def smoothing_window(runs: Sequence[PlotRun]) -> int:
    """One window (in worker steps) for every run, so their curves are smoothed alike: about a
    twentieth of the shortest run's steps, between 1 and 50. A full-batch run's few iterations do not
    count (beside SGD runs): they would leave every minibatch curve unsmoothed."""
    counts = [len(r.steps("loss")) for r in runs if len(r.steps("loss"))]
    minibatch = [len(r.steps("loss")) for r in runs if len(r.steps("loss")) and not len(r.steps("data_passes"))]
    counts = minibatch or counts
    return max(1, min(50, min(counts) // 20)) if counts else 1


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _log_loss_axis(ax: Axes) -> None:
    """A log y axis for a loss, labelled in plain numbers."""
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)


def _plain_log_ticks(axis: Any, linthresh: float | None = None) -> None:
    """Label a log axis (symlog: give its `linthresh`) in plain numbers (0.2, 1, 2), not matplotlib's
    2×10⁰: the ticks matplotlib's LogFormatter would label (fewer as the range grows), as `%g`."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    axis.set_major_formatter(PlainLogFormatter(linthresh=linthresh))
    if linthresh is None:  # symlog leaves its minor ticks unlabelled
        axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))


def _legend_below(fig: Figure, handles: Sequence[Any], ncols: int = 1) -> None:
    """The legend under the axes, outside them: it never covers a line or a bar."""
    fig.legend(handles=list(handles), loc="outside lower center", fontsize=8, ncols=ncols)


def _figure_pair(title: str) -> tuple[Figure, Axes, Axes]:
    """Two panels side by side sharing the y axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, sharey=True)
    fig.suptitle(title)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return fig, left, right


def _segments(run: PlotRun, rows: pd.DataFrame) -> list[pd.DataFrame]:
    """`rows` (in time order) cut at each failure and strategy switch: a line is never drawn across a
    recovery or a hand-over, when nothing trained."""
    cuts = sorted([f.wall_time for f in run.failures] + [s.wall_time - 1e-9 for s in run.switches])
    times = rows["wall_time"].to_numpy()
    bounds = [0, *np.searchsorted(times, cuts, side="right"), len(rows)]
    return [rows.iloc[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _mark_events(ax: Axes, runs: Sequence[PlotRun], extra: Sequence[Any] = ()) -> None:
    """Failures (dashed line, shaded until training resumed) and strategy switches (dotted line); then
    the legend: the plot's own entries, `extra` ones, and a key to the marks."""
    from matplotlib.lines import Line2D

    text = {"xycoords": ("data", "axes fraction"), "rotation": 90, "fontsize": 7, "va": "top", "ha": "right"}
    for run in runs:
        for f in run.failures:
            ax.axvline(f.wall_time, color=run.color, ls="--", lw=1.2)
            if f.resumed_at is not None:
                ax.axvspan(f.wall_time, f.resumed_at, color=run.color, alpha=0.07, lw=0)
            ax.annotate(f"{run.label}: {f.text}", (f.wall_time, 0.98), color=run.color, **text)
        for s in run.switches:
            ax.axvline(s.wall_time, color=run.color, ls=":", lw=1.5)
            ax.annotate(f"{run.label}: to {s.strategy}", (s.wall_time, 0.98), color=run.color, **text)
    proxies = []
    if any(r.failures for r in runs):
        proxies.append(Line2D([], [], color="grey", ls="--", label="failure (shaded until training resumed)"))
    if any(r.switches for r in runs):
        proxies.append(Line2D([], [], color="grey", ls=":", label="strategy switch"))
    handles, _ = ax.get_legend_handles_labels()
    _legend_below(ax.figure, [*handles, *extra, *proxies])  # legends name settings and run long
    # Time runs from the first step (0) even where the first point comes later (an evaluation).
    ax.set_xlim(left=min([0.0, *(f.wall_time for r in runs for f in r.failures)]))


def plot_accuracy(runs: Sequence[PlotRun]) -> Figure | None:
    data = [(run, run.evals()) for run in runs]
    data = [(run, ev) for run, ev in data if not ev.empty]
    if not data:
        return None
    name = _accuracy_name([run for run, _ in data])
    fig, ax = _figure(f"{name.capitalize()} against time", WALL, name)
    for run, ev in data:
        for i, seg in enumerate(_segments(run, ev)):
            ax.plot(
                seg["wall_time"], seg[run.accuracy], marker="o", ms=3, color=run.color,
                label=run.legend if i == 0 else None,
            )  # fmt: skip
    _target_line(ax, [run for run, _ in data])
    _mark_events(ax, [run for run, _ in data])  # only the runs this plot draws
    return fig


def _accuracy_name(runs: Sequence[PlotRun]) -> str:
    """What the accuracy plots' axis shows: validation accuracy (test accuracy for runs recorded before it)."""
    kinds = {run.accuracy for run in runs}
    return {frozenset({"val_accuracy"}): "validation accuracy", frozenset({"test_accuracy"}): "test accuracy"}.get(
        frozenset(kinds), "validation (older runs: test) accuracy"
    )


def _target_line(ax: Axes, runs: Sequence[PlotRun]) -> None:
    targets = {run.summary.get("target_accuracy") for run in runs} - {None}
    if len(targets) == 1:
        target = targets.pop()
        ax.axhline(target, ls="--", lw=1, color="grey", label=f"target {target:g}")


def plot_accuracy_by_progress(runs: Sequence[PlotRun]) -> Figure | None:
    """Validation accuracy against epochs completed (left) and global steps (right): time-free comparisons."""
    data = [(run, run.evals()) for run in runs]
    data = [(run, ev) for run, ev in data if not ev.empty]
    if not data:
        return None
    name = _accuracy_name([run for run, _ in data])
    fig, ax, right = _figure_pair(f"{name.capitalize()} against training progress")
    ax.set(xlabel="epochs completed", ylabel=name)
    right.set(xlabel="global steps completed")
    for run, ev in data:
        ev = ev.sort_values(["epoch", "wall_time"], kind="stable")  # a redone evaluation follows the first
        ax.plot(ev["epoch"] + 1, ev[run.accuracy], marker="o", ms=3, color=run.color, label=run.legend)
        if "step" in ev and ev["step"].notna().all():
            right.plot(ev["step"], ev[run.accuracy], marker="o", ms=3, color=run.color)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _target_line(ax, [run for run, _ in data])
    _target_line(right, [run for run, _ in data])
    _legend_below(fig, ax.get_legend_handles_labels()[0])
    return fig


def plot_loss(runs: Sequence[PlotRun]) -> Figure | None:
    data = [(run, run.steps("loss")) for run in runs]
    data = [(run, st) for run, st in data if not st.empty]
    if not data:
        return None
    w = smoothing_window(runs)
    fig, ax = _figure(f"Training loss (mean of the last {w} worker steps, in time order)", WALL, "training loss")
    for run, st in data:
        for i, seg in enumerate(_segments(run, st)):
            smooth = seg["loss"].rolling(w, min_periods=1).mean()
            ax.plot(seg["wall_time"], smooth, color=run.color, label=run.legend if i == 0 else None)
    if all((st["loss"] > 0).all() for _, st in data):
        _log_loss_axis(ax)
    _mark_events(ax, [run for run, _ in data])  # only the runs this plot draws
    return fig


def plot_throughput(runs: Sequence[PlotRun]) -> Figure | None:
    """Samples/s over a sliding window of worker steps (gradients dropped by backup workers or tasks
    left out), with each run's steady-state figure from its summary as a dashed line."""
    from matplotlib.lines import Line2D

    data = [(run, run.steps("samples")) for run in runs]
    data = [(run, st) for run, st in data if len(st) > 1]
    if not data:
        return None
    w = smoothing_window(runs)
    fig, ax = _figure(f"Training throughput (samples/s over the last {w} worker steps)", WALL, "samples/s")
    for run, st in data:
        first = True
        for seg in _segments(run, st):
            applied = seg["samples"].where(~seg["dropped"].eq(True), 0) if "dropped" in seg else seg["samples"]
            k = min(w, len(seg) - 1)
            if k < 1:
                continue
            t = seg["wall_time"].to_numpy()
            cum = np.concatenate([[0.0], np.cumsum(applied.to_numpy(dtype=float))])
            # The rows (i-k, i] took from row i-k's end to row i's end and trained on their samples.
            span = t[k:] - t[:-k]
            rate = np.divide(cum[k + 1 :] - cum[1:-k], span, out=np.full(span.shape, np.nan), where=span > 0)
            ax.plot(t[k:], rate, color=run.color, label=run.legend if first else None)
            first = False
        steady = run.summary.get("steady_state_samples_per_s")
        if steady:
            ax.axhline(steady, color=run.color, ls="--", lw=0.8, alpha=0.7)
    ax.set_ylim(bottom=0)
    steady = Line2D([], [], color="grey", ls="--", lw=0.8, label="steady state (summary.json)")
    _mark_events(ax, [run for run, _ in data], [steady])  # only the runs this plot draws
    return fig


def time_split(run: PlotRun) -> list[tuple[str, dict[str, float]]]:
    """Per phase (strategy): mean ms per worker step computing, communicating and waiting.

    Waiting is the time a parameter-server strategy's consistency rule blocked the worker (`wait_s`,
    part of the round trip `comm_s`); an all-reduce records no such split, so its wait for the slowest
    worker is inside its communication time.
    """
    st = run.steps("compute_s")
    out = []
    for start, end, strategy in run.phases:
        rows = st[(st["step"] >= start) & (st["step"] < end)]
        if rows.empty:
            continue
        wait = rows["wait_s"].fillna(0.0) if "wait_s" in rows else pd.Series(0.0, index=rows.index)
        comm = rows["comm_s"].fillna(0.0) if "comm_s" in rows else pd.Series(0.0, index=rows.index)
        parts = {
            "compute": 1000 * float(rows["compute_s"].mean()),
            "communication": 1000 * float((comm - wait).clip(lower=0).mean()),
            "wait": 1000 * float(wait.mean()),
        }
        out.append((strategy, parts))
    return out


def plot_time_split(runs: Sequence[PlotRun]) -> Figure | None:
    bars = [(f"{run.label}\n{strategy}", parts) for run in runs for strategy, parts in time_split(run)]
    if not bars:
        return None
    fig, ax = _figure(
        "Where a worker step's time goes, per run and strategy",
        "mean ms per worker step (an all-reduce's wait for the slowest counts as communication)",
        "",
    )
    y = np.arange(len(bars))[::-1]
    left = np.zeros(len(bars))
    for part, color in SPLIT_COLORS.items():
        values = np.array([parts[part] for _, parts in bars])
        ax.barh(y, values, left=left, color=color, label=part, height=0.6)
        left += values
    for yi, total in zip(y, left, strict=True):
        ax.annotate(f" {total:.1f}", (total, yi), va="center", fontsize=8)
    ax.set_yticks(y, [name for name, _ in bars], fontsize=8)
    ax.set_xlim(right=left.max() * 1.12 if left.max() > 0 else 1)
    _legend_below(fig, ax.get_legend_handles_labels()[0], ncols=len(SPLIT_COLORS))
    return fig


def plot_step_times(runs: Sequence[PlotRun]) -> Figure | None:
    boxes, labels, colors = [], [], []
    for run in runs:
        st = run.steps("worker")
        for worker, rows in st.groupby("worker"):
            boxes.append(1000 * (rows["compute_s"].fillna(0) + rows["comm_s"].fillna(0)).to_numpy())
            labels.append(f"{run.label}\nw{int(worker)}")
            colors.append(run.color)
    if not boxes:
        return None
    fig, ax = _figure("Step time per worker (compute + communication)", "", "ms per step")
    parts = ax.boxplot(boxes, patch_artist=True, flierprops={"markersize": 2, "alpha": 0.4})
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30 if len(labels) > 6 else 0, fontsize=8)
    for box, color in zip(parts["boxes"], colors, strict=True):
        box.set(facecolor=color, alpha=0.5)
    ax.set_ylim(bottom=0)
    return fig


def histogram_plot(spec: ColumnPlot) -> Callable[[Sequence[PlotRun]], Figure | None]:
    """A declared "histogram" plot: each run's share of steps per integer value of `spec.column`."""

    def draw(runs: Sequence[PlotRun]) -> Figure | None:
        data = [(run, run.steps(spec.column)) for run in runs]
        data = [(run, st) for run, st in data if not st.empty]
        if not data:
            return None
        values = [st[spec.column].astype(int).to_numpy() for _, st in data]
        fig, ax = _figure(spec.title, spec.axis_label, "share of steps")
        ax.hist(
            values,
            bins=[b - 0.5 for b in range(max(v.max() for v in values) + 2)],
            weights=[[1 / len(v)] * len(v) for v in values],
            color=[run.color for run, _ in data],
            label=[run.legend for run, _ in data],
        )
        ax.xaxis.get_major_locator().set_params(integer=True)
        _legend_below(fig, ax.get_legend_handles_labels()[0])
        return fig

    return draw


def over_time_plot(spec: ColumnPlot) -> Callable[[Sequence[PlotRun]], Figure | None]:
    """A declared "over_time" plot: `spec.column` over wall time, only when some run's value changed (a
    constant one is in the legend already)."""
    column = spec.column

    def draw(runs: Sequence[PlotRun]) -> Figure | None:
        data = [(run, run.steps(column)) for run in runs]
        data = [(run, st) for run, st in data if not st.empty]
        if not any(st[column].nunique() > 1 for _, st in data):
            return None
        fig, ax = _figure(spec.title, WALL, spec.axis_label)
        for run, st in data:
            for i, seg in enumerate(_segments(run, st)):
                label = run.legend if i == 0 else None
                ax.step(seg["wall_time"], seg[column], where="post", color=run.color, label=label)
                changed = seg[seg[column].ne(seg[column].shift())]
                ax.plot(changed["wall_time"], changed[column], "o", ms=4, color=run.color)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(bottom=0)
        _mark_events(ax, [run for run, _ in data])  # only the runs this plot draws
        return fig

    return draw


COLUMN_PLOT_KINDS = {"histogram": histogram_plot, "over_time": over_time_plot}


def column_plot(spec: ColumnPlot) -> Callable[[Sequence[PlotRun]], Figure | None]:
    """The drawing function of a plot a strategy column family declares (strategies/step_columns.py)."""
    draw = COLUMN_PLOT_KINDS[spec.kind](spec)
    draw.__name__ = draw.__qualname__ = f"plot_{spec.column}"
    return draw


def bytes_per_worker(run: PlotRun) -> pd.DataFrame:
    """Its step rows in wall-time order with `sent_mb`: megabytes each worker has sent so far (all
    workers' bytes_sent summed, divided by the number of workers that sent; steps redone after a
    failure count again, they went on the wire again)."""
    st = run.steps("bytes_sent")
    if st.empty:
        return st
    workers = max(1, st["worker"].nunique())
    return st.assign(sent_mb=st["bytes_sent"].astype(float).cumsum() / workers / 1e6)


def plot_loss_vs_bytes(runs: Sequence[PlotRun]) -> Figure | None:
    """Training loss against the bytes a worker has sent: what each strategy pays in traffic for its
    progress (DiLoCo's and local SGD's curves reach a loss at a fraction of BSP's bytes)."""
    data = [(run, bytes_per_worker(run)) for run in runs]
    data = [(run, st) for run, st in data if not st.empty and st["sent_mb"].iloc[-1] > 0]
    if not data:
        return None
    w = smoothing_window(runs)
    fig, ax = _figure(
        f"Training loss (mean of the last {w} worker steps) against traffic", "MB sent per worker", "training loss"
    )
    for run, st in data:
        ax.plot(st["sent_mb"], st["loss"].rolling(w, min_periods=1).mean(), color=run.color, label=run.legend)
    totals = [st["sent_mb"].iloc[-1] for _, st in data]
    if max(totals) > 30 * min(totals):  # strategies a decade or more apart: each visible on its own scale
        linthresh = max(min(totals) / 10, 1e-3)
        ax.set_xscale("symlog", linthresh=linthresh)
        _plain_log_ticks(ax.xaxis, linthresh)
    if all((st["loss"] > 0).all() for _, st in data):
        _log_loss_axis(ax)
    _legend_below(fig, ax.get_legend_handles_labels()[0])
    return fig


def passes_over_data(run: PlotRun) -> pd.DataFrame:
    """Its step rows in order of `passes`: passes over the training set so far. A full-batch
    run (Sandblaster) counts its own (`data_passes`: gradient and line-search passes, one row per
    iteration); a minibatch run's step k of an epoch of S steps has made (k + 1) / S passes."""
    st = run.steps("loss")
    if st.empty:
        return st
    if "data_passes" in st and st["data_passes"].notna().any():
        st = st[st["data_passes"].notna()].drop_duplicates("step")
        return st.assign(passes=st["data_passes"].astype(float))
    epochs, steps = run.summary.get("epochs_completed"), run.summary.get("steps_completed")
    if not epochs or not steps:
        return st.iloc[0:0]
    passes = st.assign(passes=(st["step"].astype(float) + 1) / (steps / epochs))
    # Under async/SSP each worker counts its own steps, so wall-time order is not step order: sort by the
    # x axis (stable, so rows of one step keep their time order) or the line would run backwards.
    return passes.sort_values("passes", kind="stable")


def plot_loss_vs_passes(runs: Sequence[PlotRun]) -> Figure | None:
    """Training loss against passes over the training set: what a batch method (Sandblaster's L-BFGS or
    GD, whose loss is the full-batch objective) pays in data passes beside SGD (minibatch losses,
    smoothed over the workers' last steps)."""
    data = [(run, passes_over_data(run)) for run in runs]
    data = [(run, st) for run, st in data if not st.empty]
    if not data or not any("data_passes" in st and st["data_passes"].notna().any() for _, st in data):
        return None  # only drawn when some run is a full-batch one
    w = smoothing_window(runs)
    fig, ax = _figure("Training loss against passes over the training set", "passes over the data", "training loss")
    for run, st in data:
        full = "data_passes" in st and st["data_passes"].notna().any()
        loss = st["loss"] if full else st["loss"].rolling(w, min_periods=1).mean()
        ax.plot(st["passes"], loss, color=run.color, label=run.legend, marker="." if full else None)
    if all((st["loss"] > 0).all() for _, st in data):
        _log_loss_axis(ax)
    _legend_below(fig, ax.get_legend_handles_labels()[0])
    return fig


def plot_bytes(runs: Sequence[PlotRun]) -> Figure | None:
    """Megabytes sent per worker so far, against wall time."""
    data = [(run, bytes_per_worker(run)) for run in runs]
    data = [(run, st) for run, st in data if not st.empty and st["sent_mb"].iloc[-1] > 0]
    if not data:
        return None
    fig, ax = _figure("Traffic: megabytes sent per worker so far", WALL, "MB sent per worker")
    for run, st in data:
        for i, seg in enumerate(_segments(run, st)):
            ax.plot(seg["wall_time"], seg["sent_mb"], color=run.color, label=run.legend if i == 0 else None)
    ax.set_ylim(bottom=0)
    _mark_events(ax, [run for run, _ in data])
    return fig


def plot_pipeline_timeline(runs: Sequence[PlotRun]) -> Figure | None:
    """A pipeline's schedule as it ran: one lane per stage (replica 0), each micro-batch's forward and
    backward as a bar, for the few steps whose spans the stages recorded (`pipe_spans`, wall-clock
    seconds); the first run that has them. Gaps in a lane are its idle time (the bubble and waits)."""
    import json

    for run in runs:
        st = run.steps("pipe_spans")
        if "replica" in st:
            st = st[st["replica"] == 0]
        if "shard" in st:  # stages sharded over --fsdp D: one of the replica's D pipelines, shard 0's
            st = st[st["shard"].fillna(0) == 0]
        if st.empty:
            continue
        origin = min(min(t0 for _, _, t0, _ in json.loads(v)) for v in st["pipe_spans"])
        end = max(max(t1 for _, _, _, t1 in json.loads(v)) for v in st["pipe_spans"])
        fig, ax = _figure(f"Pipeline timeline, {run.label} (replica 0)", "seconds", "stage")
        colors = {"F": "#4c72b0", "B": "#dd8452"}
        for _, row in st.iterrows():
            stage = int(row["stage"])
            for kind, mb, t0, t1 in json.loads(row["pipe_spans"]):
                ax.broken_barh([(t0 - origin, t1 - t0)], (stage - 0.4, 0.8), color=colors[kind], alpha=0.85)
                if t1 - t0 > 0.02 * (end - origin):  # labelled where the bar has room
                    ax.text((t0 + t1) / 2 - origin, stage, f"{kind}{mb}", ha="center", va="center", fontsize=6)
        stages = sorted(int(s) for s in st["stage"].unique())
        ax.set_yticks(stages, [f"stage {s}" for s in stages])
        ax.invert_yaxis()
        from matplotlib.patches import Patch

        names = {"F": "forward", "B": "backward"}
        _legend_below(fig, [Patch(color=c, label=names[k]) for k, c in colors.items()], ncols=2)
        ax.set_xlim(0, end - origin)
        return fig
    return None


@dataclass(frozen=True)
class Plot:
    """One plot of the report: the function that draws it and the caption report.md gives it ({w}: the
    smoothing window). Kept together, so a plot cannot be added without its caption."""

    draw: Callable[[Sequence[PlotRun]], Figure | None]
    caption: str


DECLARED_PLOTS: dict[str, Plot] = {
    spec.file: Plot(column_plot(spec), spec.caption) for family in STEP_COLUMN_FAMILIES for spec in family.plots
}
# Two of them under the names earlier versions exported them by (tests and notebooks call these).
plot_staleness = DECLARED_PLOTS["staleness_hist.png"].draw
plot_tau = DECLARED_PLOTS["tau_over_time.png"].draw

PLOTS: dict[str, Plot] = {
    "accuracy_vs_time.png": Plot(plot_accuracy, "Validation accuracy at each evaluation against wall time."),
    "accuracy_vs_progress.png": Plot(
        plot_accuracy_by_progress, "Validation accuracy against epochs completed and global steps completed."
    ),
    "loss_vs_time.png": Plot(
        plot_loss, "Training loss, each worker step in wall-time order, mean of the last {w} worker steps."
    ),
    "loss_vs_bytes.png": Plot(
        plot_loss_vs_bytes, "Training loss against megabytes sent per worker so far (the traffic each strategy paid)."
    ),
    "loss_vs_passes.png": Plot(
        plot_loss_vs_passes,
        "Training loss against passes over the training set: a full-batch run's own count of gradient and "
        "line-search passes (one point per iteration) beside the minibatch runs' epochs (mean of the last {w} "
        "worker steps).",
    ),
    "bytes_vs_time.png": Plot(plot_bytes, "Megabytes sent per worker so far, against wall time."),
    "throughput_vs_time.png": Plot(
        plot_throughput,
        "Samples/s over the last {w} worker steps (dropped gradients left out); dashed: summary.json's "
        "steady-state figure.",
    ),
    "time_split.png": Plot(
        plot_time_split,
        "Mean time of a worker step computing, communicating and blocked by the consistency rule (parameter "
        "server), per run and strategy phase. An all-reduce's wait for the slowest worker is part of its "
        "communication time.",
    ),
    "step_time_per_worker.png": Plot(
        plot_step_times, "Distribution of compute + communication time per step, per worker."
    ),
    # the plots the strategies' column families declare (the parameter server's staleness, local SGD's τ)
    **DECLARED_PLOTS,
    "pipeline_timeline.png": Plot(
        plot_pipeline_timeline,
        "A pipeline's stages (replica 0) over a few steps: each micro-batch's forward (F) and backward (B); gaps "
        "are idle time, the bubble and the waits between stages.",
    ),
}
