"""`distrain report`: compare finished runs in one table (terminal and `report.md`) and a few PNG plots.

Every input must be a run directory (config.yaml, summary.json, metrics.parquet); anything else is a
`DistrainError` naming the path, raised before anything is written. Plots are drawn on Agg canvases
(`matplotlib.figure.Figure`, never pyplot), so no display is needed and no global backend is touched;
each plot is written only when some run has its data.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa

from distrain.config import RunConfig
from distrain.errors import ConfigError, DistrainError
from distrain.orchestrator.files import atomic_write, atomic_write_text, fresh_dir

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

RUN_FILES = ("config.yaml", "summary.json", "metrics.parquet")
COLUMNS = (
    "run", "strategy", "workers", "final accuracy", "time to target (s)", "samples/s (steady state)",
    "staleness p95", "bytes/step", "failures",
)  # fmt: skip
FIGURES = {  # summary.json key -> format, for the columns between "workers" and "failures"
    "final_test_accuracy": ".4f",
    "time_to_target_s": ".1f",
    "steady_state_samples_per_s": ",.0f",
    "staleness_p95": "g",
    "bytes_per_step": ",.0f",
}
FIGSIZE, DPI = (8.0, 5.0), 100  # every plot is 800 x 500 px
WALL = "wall time since the run started (s)"


@dataclass
class Run:
    path: Path
    label: str
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: pd.DataFrame


def load_run(path: Path) -> Run:
    """One run directory; a `DistrainError` naming the path if it is not a readable one."""
    if not path.exists():
        raise DistrainError(f"run directory {str(path)!r} not found")
    if not path.is_dir():
        raise DistrainError(f"{str(path)!r} is not a directory; pass run directories written by `distrain run`")
    missing = [name for name in RUN_FILES if not (path / name).is_file()]
    if missing:
        raise DistrainError(
            f"{str(path)!r} is not a distrain run directory (no {', '.join(missing)}); "
            "pass run directories written by `distrain run`"
        )
    config = _read(path / "config.yaml", RunConfig.load_yaml, "run configuration", dict)
    summary = _read(path / "summary.json", lambda p: json.loads(p.read_text()), "run summary", dict)
    metrics = _read(path / "metrics.parquet", pd.read_parquet, "metrics file", pd.DataFrame)
    if not {"kind", "wall_time"} <= set(metrics.columns):
        raise DistrainError(f"{str(path / 'metrics.parquet')!r} is not a readable metrics file")
    return Run(path, path.name, config, summary, metrics)


def _read(path: Path, read: Callable[[Path], Any], what: str, expect: type) -> Any:
    try:
        value = read(path)
    except (OSError, ValueError, pa.ArrowException, ConfigError):
        value = None
    if not isinstance(value, expect):
        raise DistrainError(f"{str(path)!r} is not a readable {what}")
    return value


def load_runs(paths: Sequence[Path]) -> list[Run]:
    """All the runs, in the order given; runs whose directory names collide are labelled by path."""
    runs = [load_run(Path(p)) for p in paths]
    names = [run.label for run in runs]
    for run in runs:
        if names.count(run.label) > 1:
            run.label = str(run.path)
    return runs


def choose_out_dir(requested: Path | None) -> Path:
    """The report directory: `--out` if new or empty, else report-<timestamp>/ here. Creates nothing."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return fresh_dir(requested, lambda n: Path(f"report-{stamp}" + (f"-{n}" if n > 1 else "")), "--out")


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _failures(summary: dict[str, Any]) -> int:
    value = summary.get("failures") or 0
    return len(value) if isinstance(value, list | dict) else int(value)


def table_rows(runs: Sequence[Run]) -> list[list[str]]:
    """One row of `COLUMNS` per run, as display strings ('-' where a figure does not apply)."""
    rows = []
    for run in runs:
        s, c = run.summary, run.config
        label = run.label if s.get("status", "completed") == "completed" else f"{run.label} ({s['status']})"
        strategy = str(s.get("strategy", c.get("strategy", "?")))
        if strategy == "ssp" and c.get("staleness") is not None:
            strategy += f" s={c['staleness']}"
        if c.get("transport") == "ps":
            shards = c.get("ps_shards") or 1
            strategy += " (ps)" if shards == 1 else f" (ps, {shards} shards)"
        workers = str(s.get("workers", c.get("workers", "?")))
        figures = [_fmt(s.get(key), spec) for key, spec in FIGURES.items()]
        rows.append([label, strategy, workers, *figures, str(_failures(s))])
    return rows


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    align = ["---", "---"] + ["---:"] * (len(COLUMNS) - 2)
    return "\n".join([line(COLUMNS), line(align), *(line(r) for r in rows)]) + "\n"


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _series(runs: Sequence[Run], column: str, kind: str = "step") -> list[tuple[str, Run, pd.DataFrame]]:
    """(colour, run, its `kind` rows where `column` is set, by time) for each run that has some."""
    found = []
    for i, run in enumerate(runs):
        df = run.metrics
        if column in df:
            rows = df[(df["kind"] == kind) & df[column].notna()].sort_values("wall_time")
            if not rows.empty:
                found.append((f"C{i % 10}", run, rows))
    return found


def plot_accuracy(runs: Sequence[Run]) -> Figure | None:
    data = _series(runs, "test_accuracy", kind="eval")
    if not data:
        return None
    fig, ax = _figure("Test accuracy", WALL, "test accuracy")
    for color, run, ev in data:
        ax.plot(ev["wall_time"], ev["test_accuracy"], marker="o", ms=3, color=color, label=run.label)
    targets = {run.summary.get("target_accuracy") for _, run, _ in data} - {None}
    if len(targets) == 1:
        target = targets.pop()
        ax.axhline(target, ls="--", lw=1, color="grey", label=f"target {target:g}")
    ax.legend()
    return fig


def plot_loss(runs: Sequence[Run]) -> Figure | None:
    data = _series(runs, "loss")
    if not data:
        return None
    fig, ax = _figure("Training loss (mean over workers per global step, smoothed)", WALL, "loss")
    for color, run, st in data:
        per_step = st.groupby("step").agg(loss=("loss", "mean"), t=("wall_time", "max")).sort_index()
        smooth = per_step["loss"].rolling(min(max(1, len(per_step) // 10), 50), min_periods=1).mean()
        ax.plot(per_step["t"], smooth, color=color, label=run.label)
    if all((d[2]["loss"] > 0).all() for d in data):
        ax.set_yscale("log")
    ax.legend()
    return fig


def plot_step_times(runs: Sequence[Run]) -> Figure | None:
    boxes, labels, colors = [], [], []
    for color, run, st in _series(runs, "worker"):
        for worker, rows in st.groupby("worker"):
            boxes.append(1000 * (rows["compute_s"].fillna(0) + rows["comm_s"].fillna(0)).to_numpy())
            labels.append(f"{run.label}\nw{int(worker)}")
            colors.append(color)
    if not boxes:
        return None
    fig, ax = _figure("Step time per worker (compute + communication)", "", "ms per step")
    parts = ax.boxplot(boxes, patch_artist=True, flierprops={"markersize": 2, "alpha": 0.4})
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30 if len(labels) > 6 else 0, fontsize=8)
    for box, color in zip(parts["boxes"], colors, strict=True):
        box.set(facecolor=color, alpha=0.5)
    ax.set_ylim(bottom=0)
    return fig


def plot_staleness(runs: Sequence[Run]) -> Figure | None:
    data = _series(runs, "staleness")
    if not data:
        return None
    values = [st["staleness"].astype(int).to_numpy() for _, _, st in data]
    fig, ax = _figure("Staleness of applied gradients", "staleness (versions between read and apply)", "share of steps")
    ax.hist(
        values,
        bins=[b - 0.5 for b in range(max(v.max() for v in values) + 2)],
        weights=[[1 / len(v)] * len(v) for v in values],
        color=[color for color, _, _ in data],
        label=[run.label for _, run, _ in data],
    )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    return fig


def plot_tau(runs: Sequence[Run]) -> Figure | None:
    data = _series(runs, "tau")
    if not data:
        return None
    fig, ax = _figure("Local steps between averaging (tau)", WALL, "tau")
    for color, run, st in data:
        per_step = st.groupby("step").agg(tau=("tau", "last"), t=("wall_time", "max")).sort_index()
        ax.step(per_step["t"], per_step["tau"], where="post", color=color, label=run.label)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    return fig


PLOTS: dict[str, Callable[[Sequence[Run]], Figure | None]] = {
    "accuracy_vs_time.png": plot_accuracy,
    "loss_vs_time.png": plot_loss,
    "step_time_per_worker.png": plot_step_times,
    "staleness_hist.png": plot_staleness,
    "tau_over_time.png": plot_tau,
}


def write_report(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    """Write the plots that have data and `report.md` into out_dir (created); the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in PLOTS.items():
        fig = plot(runs)
        if fig is not None:
            atomic_write(out_dir / name, lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=DPI))
            written.append(out_dir / name)
    text = "# distrain report\n\n" + "\n".join(f"- `{run.label}`: `{run.path}`" for run in runs) + "\n\n"
    text += markdown_table(table_rows(runs))
    text += "".join(f"\n![{p.stem}]({p.name})\n" for p in written)
    atomic_write_text(out_dir / "report.md", text)
    return [out_dir / "report.md", *written]
