"""`distrain report`: compare runs in one table (terminal and `report.md`) and PNG plots.

Every input must be a run directory (config.yaml, summary.json, metrics.parquet); anything else is a
`DistrainError` naming the path, raised before anything is written. A directory given twice is
reported once. Everything is rendered in memory first and then written; a report directory that
cannot be written is one `DistrainError`, with whatever this report had written removed. The plots
themselves are in `plots.py`; each is written only when some run has its data.
"""

from __future__ import annotations

import io
import json
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa

from distrain.compression.spec import KEY as CODEC_KEY
from distrain.compression.spec import codec_settings_text
from distrain.config import RunConfig
from distrain.errors import ConfigError, DistrainError
from distrain.orchestrator.files import atomic_write, fresh_dir
from distrain.reporting.gpu import gpu_section
from distrain.reporting.markdown import markdown_table
from distrain.reporting.plots import DPI, PLOTS, Failure, PlotRun, Switch, smoothing_window
from distrain.reporting.prediction import prediction_section
from distrain.strategies.step_columns import STEP_COLUMN_FAMILIES
from distrain.strategies.strategy_lookup import STRATEGIES, strategy_class
from distrain.units import size_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from distrain.strategies.base import Strategy

RUN_FILES = ("config.yaml", "summary.json", "metrics.parquet")
# The strategies' column families (strategies/step_columns.py) each may bring a column of the table: the
# parameter server's "staleness p95".
FAMILY_COLUMNS = [family.report_column for family in STEP_COLUMN_FAMILIES if family.report_column]
COLUMNS = (
    "run", "strategy", "workers", "val accuracy", "test accuracy", "time to target (s)", "samples/s (steady state)",
    *(header for header, _, _ in FAMILY_COLUMNS), "bytes/step", "peak memory", "failures",
)  # fmt: skip
FIGURES: dict[str, str | Callable[[float], str]] = {  # summary.json key -> format spec or formatter,
    # for the columns between "workers" and "failures"
    # the last evaluation's, on the validation split (what targets select on) and the test set, apart
    "final_val_accuracy": ".4f",
    "final_test_accuracy": ".4f",
    "time_to_target_s": ".1f",
    "steady_state_samples_per_s": ",.0f",
    **{key: spec for _, key, spec in FAMILY_COLUMNS},
    "bytes_per_step": size_text,  # "680.0 kB", as the run's closing summary prints it
    "peak_memory_bytes": size_text,  # the largest worker's peak resident memory (orchestrator/peak_memory.py)
}
# Settings the strategy column already states (with the strategy that reads them: each built-in
# strategy's `described_options`, added by `shown_with_strategy`), and ones that say where a run was
# written or ran rather than what it did: left out of "settings that differ".
RUN_SETTINGS_SHOWN = ("strategy", "schedule", "transport", "ps_shards", CODEC_KEY)
NOT_SETTINGS = ("run_dir", "tensorboard", "address", "data_dir", "resume")


@dataclass
class Run:
    path: Path  # where its files are read: the directory, or a --storage URI's local copy
    label: str
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: pd.DataFrame
    given: str | None = None  # how the user named it (a URI such as s3://bucket/runs/r); None: `path`

    @property
    def source(self) -> str:
        """The run as the user named it: the report names it so, never by a download cache's path."""
        return self.given or str(self.path)


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


def load_runs(paths: Sequence[Path], given: Sequence[str] | None = None) -> list[Run]:
    """All the runs, in the order given; `given`: how the user named each (a --storage URI whose local
    copy `paths` holds), by which the report names it. Runs whose directory names collide are labelled
    by that name in full."""
    runs = [load_run(Path(p)) for p in paths]
    for run, name in zip(runs, given or [None] * len(runs), strict=True):
        run.given = name
    names = [run.label for run in runs]
    for run in runs:
        if names.count(run.label) > 1:
            run.label = run.source
    return runs


def distinct_dirs(paths: Sequence[Path]) -> tuple[list[int], list[tuple[int, int]]]:
    """The indices of `paths` with each directory once (however it is spelled; a URI's local copy is
    one directory per URI), in order, and each repeat's index paired with the index kept for it."""
    first: dict[Path, int] = {}
    kept, repeats = [], []
    for i, path in enumerate(map(Path, paths)):
        key = path.resolve()
        if key in first:
            repeats.append((i, first[key]))
        else:
            first[key] = i
            kept.append(i)
    return kept, repeats


def choose_out_dir(requested: Path | None) -> Path:
    """The report directory: `--out` if new or empty, else report-<timestamp>/ here. Creates nothing."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return fresh_dir(requested, lambda n: Path(f"report-{stamp}" + (f"-{n}" if n > 1 else "")), "--out")


def _fmt(value: Any, spec: str | Callable[[float], str]) -> str:
    if value is None:
        return "-"
    return spec(value) if callable(spec) else format(value, spec)


def _failures(summary: dict[str, Any]) -> int:
    value = summary.get("failures") or 0
    return len(value) if isinstance(value, list | dict) else int(value)


def _strategy(name: str) -> type[Strategy] | None:
    """The strategy class `name` means, or None (a plugin that cannot be imported here, a strategy of an
    earlier version): the report then shows the name alone."""
    try:
        return strategy_class(name)
    except DistrainError:
        return None


def shown_with_strategy() -> set[str]:
    """Every setting the strategy column states: the run's own and each built-in strategy's options."""
    import distrain.strategies  # noqa: F401 - registers the built-in strategies

    return set(RUN_SETTINGS_SHOWN) | {o for name in STRATEGIES.names() for o in STRATEGIES.get(name).described_options}


def strategy_text(config: dict[str, Any], strategy: str | None = None) -> str:
    """The strategy and the settings that make it what it is: "ssp s=2 (ps)", "local-sgd tau=8 adaptive
    (10%, max 16)", "bsp (ps, 2 shards) backup-workers=1", "schedule bsp:2 -> local-sgd tau=8" (each
    strategy's own part from its `settings_text` and `run_settings_text`). With `strategy`, one phase of
    the config's schedule."""
    c = config
    if strategy is None and c.get("schedule"):
        entries = [e.strip().partition(":") for e in str(c["schedule"]).split(",")]
        # each phase as name:epochs and its settings: "bsp:1 -> local-sgd tau=8"
        phases = [strategy_text(c, name).replace(name, f"{name}:{n}" if n else name, 1) for name, _, n in entries]
        return "schedule " + " -> ".join(phases)
    name = strategy or str(c.get("strategy", "?"))
    cls = _strategy(name)
    text = name + (cls.settings_text(c) if cls else "")
    # a phase runs on its strategy's default transport (a schedule names no transport per phase)
    default_transport = cls.transports[0] if cls else None
    transport = c.get("transport") if strategy is None else (default_transport if default_transport == "ps" else None)
    if transport == "ps":
        shards = c.get("ps_shards") or 1
        text += " (ps)" if shards == 1 else f" (ps, {shards} shards)"
    if strategy is None:
        text += codec_settings_text(c)
        text += cls.run_settings_text(c) if cls else ""
    return text


def table_rows(runs: Sequence[Run]) -> list[list[str]]:
    """One row of `COLUMNS` per run, as display strings ('-' where a figure does not apply)."""
    rows = []
    for run in runs:
        s, c = run.summary, run.config
        label = run.label if s.get("status", "completed") == "completed" else f"{run.label} ({s['status']})"
        if "strategy" in s and not c.get("schedule"):
            c = c | {"strategy": s["strategy"]}
        workers = str(s.get("workers", c.get("workers", "?")))
        if s.get("worker_shares"):  # heterogeneous workers: each one's samples per step (at the end)
            workers += f" (b={'/'.join(map(str, s['worker_shares']))})"
        figures = [_fmt(s.get(key), spec) for key, spec in FIGURES.items()]
        rows.append([label, strategy_text(c), workers, *figures, str(_failures(s))])
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) if value else "none"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) if value else "none"
    if value is None or value == "":
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def differing_settings(runs: Sequence[Run]) -> list[str]:
    """The config keys whose values are not the same in every run (strategy settings excepted: the
    strategy column states them), in config order."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.config if k not in keys]
    skip = shown_with_strategy() | set(NOT_SETTINGS)
    return [k for k in keys if k not in skip and len({_cell(r.config.get(k)) for r in runs}) > 1]


def _empty(value: Any) -> bool:
    return value in (None, "", 0, False) or (isinstance(value, list | tuple | dict) and not value)


def legend_text(run: Run, differing: Sequence[str]) -> str:
    """Label, strategy with its settings, and this run's values of the settings that differ between the
    runs (those left empty or off in this run are not named)."""
    extra = [f"{k.replace('_', '-')} {_cell(run.config.get(k))}" for k in differing if not _empty(run.config.get(k))]
    return f"{run.label}: " + "; ".join([strategy_text(run.config), *extra])


def _failure_events(summary: dict[str, Any]) -> list[dict[str, Any]]:
    events = summary.get("failure_events")
    if events is None and isinstance(summary.get("failures"), list):
        events = summary["failures"]
    return [e for e in events or [] if isinstance(e, dict) and e.get("wall_time") is not None]


def plot_run(run: Run, color: str, legend: str) -> PlotRun:
    """What the plots need of a run: its events placed in wall time, its phases with their strategies.
    Times count from the run's first step (the actors' start-up before it is not training)."""
    first = run.metrics.loc[run.metrics["kind"] == "step", "wall_time"].min()
    origin = float(first) if pd.notna(first) else 0.0
    metrics = run.metrics.assign(wall_time=run.metrics["wall_time"] - origin)
    steps = metrics[metrics["kind"] == "step"]
    times = steps["wall_time"].sort_values().to_numpy()
    failures = []
    for e in _failure_events(run.summary):
        t = float(e["wall_time"]) - origin
        later = times[times > t]
        what = f"{e.get('kind', '?')} {e.get('target', '')}".strip()
        how = e.get("action", "lost")
        if e.get("restored_step") is not None:
            how += f" from step {e['restored_step']}"
        failures.append(Failure(t, float(later[0]) if len(later) else None, f"{what} lost, {how}"))
    phases = run.summary.get("phases") or []
    spans = [(int(p["start_step"]), int(p["end_step"]), strategy_text(run.config, p["strategy"])) for p in phases]
    if not spans:
        spans = [(0, 2**62, strategy_text(run.config))]
    switches = []
    for start, end, text in spans[1:]:
        rows = steps[(steps["step"] >= start) & (steps["step"] < end)]
        if not rows.empty:
            switches.append(Switch(float(rows["wall_time"].min()), start, text))
    return PlotRun(run.label, legend, color, metrics, run.summary, spans, failures, switches, origin)


def plot_runs(runs: Sequence[Run]) -> list[PlotRun]:
    differing = differing_settings(runs)
    # Legends are wrapped at spaces so a long one stays inside an 800 px plot.
    legends = [
        textwrap.fill(legend_text(run, differing), 95, subsequent_indent="  ", break_on_hyphens=False) for run in runs
    ]
    return [plot_run(run, f"C{i % 10}", legend) for i, (run, legend) in enumerate(zip(runs, legends, strict=True))]


def _common(runs: Sequence[Run], key: str) -> str | None:
    values = {_cell(r.config.get(key)) for r in runs}
    return values.pop() if len(values) == 1 else None


def _target(run: Run) -> str:
    s = run.summary
    if s.get("target"):
        return str(s["target"])
    return f"test_accuracy>={s.get('target_accuracy', run.config.get('target_accuracy'))}"


def setup_text(runs: Sequence[Run]) -> str:
    """What the runs trained and towards what: model, data set (or task) and target, where shared."""
    parts = []
    builtin = all(not r.config.get("task") for r in runs)  # a user task brings its own model and data
    for key, name in (("model", "model"), ("dataset", "data set")) if builtin else (("task", "task"),):
        value = _common(runs, key)
        parts.append(f"{name} `{value}`" if value is not None else f"{name}: differs (see below)")
    targets = {_target(r) for r in runs}
    parts.append(f"target `{targets.pop()}`" if len(targets) == 1 else "target: differs per run")
    return (
        "Trained: " + ", ".join(parts) + ". Time to target counts from each run's start; the plots' time axes "
        "and the events below from each run's first step.\n"
    )


def settings_section(runs: Sequence[Run]) -> str:
    if len(runs) < 2:
        return ""
    keys = differing_settings(runs)
    if not keys:
        return "## Settings that differ between runs\n\nNone besides the strategy settings in the table above.\n"
    rows = [[run.label, strategy_text(run.config), *(_cell(run.config.get(k)) for k in keys)] for run in runs]
    table = markdown_table(rows, ["run", "strategy", *keys], numeric_from=len(keys) + 2)
    return "## Settings that differ between runs\n\n" + table


def events_section(plotted: Sequence[PlotRun]) -> str:
    lines = []
    for run in plotted:
        for f in run.failures:
            back = f"training resumed at {f.resumed_at:.1f} s" if f.resumed_at is not None else "no training after"
            lines.append(f"- `{run.label}`: at {f.wall_time:.1f} s {f.text}; {back}")
        for sw in run.switches:
            lines.append(f"- `{run.label}`: switched to {sw.strategy} at step {sw.step} ({sw.wall_time:.1f} s)")
    body = "\n".join(lines) if lines else "None."
    heading = "## Failures and strategy switches (marked on the plots; seconds since the run's first step)"
    return heading + "\n\n" + body + "\n"


def render(runs: Sequence[Run]) -> dict[str, bytes]:
    """Every file of the report, by name, rendered in memory (nothing touches the disk)."""
    plotted = plot_runs(runs)
    files: dict[str, bytes] = {}
    for name, plot in PLOTS.items():
        fig: Figure | None = plot.draw(plotted)
        if fig is not None:
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=DPI)
            files[name] = buffer.getvalue()
    w = smoothing_window(plotted)
    text = "# distrain report\n\n" + setup_text(runs) + "\n"
    text += "\n".join(f"- `{run.label}`: `{run.source}`" for run in runs) + "\n\n"
    text += markdown_table(table_rows(runs), COLUMNS) + "\n"

    sections = (settings_section(runs), gpu_section(runs), events_section(plotted), prediction_section(runs))
    text += "".join(s + "\n" for s in sections if s)
    if files:
        text += "## Plots\n"
        text += "".join(f"\n{PLOTS[n].caption.format(w=w)}\n\n![{Path(n).stem}]({n})\n" for n in files)
    return {"report.md": text.encode(), **files}


def write_report(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    """Write `report.md` and the plots that have data into out_dir (created); the files written.

    A place that cannot be written (under a regular file, a read-only file system, a full disk) is one
    `DistrainError`, and the files and directories this call made are removed again.
    """
    files = render(runs)
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # what mkdir will create
    written: list[Path] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            atomic_write(out_dir / name, lambda tmp, data=data: Path(tmp).write_bytes(data))
            written.append(out_dir / name)
    except OSError as e:
        for path in written:
            path.unlink(missing_ok=True)
        for d in made:  # deepest first; only directories this call created, and only if empty
            _rmdir(d)
        reason = e.strerror or str(e)
        raise DistrainError(f"cannot write the report to {str(out_dir)!r}: {reason}; choose another --out") from None
    return written


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
