"""`distrain run`'s closing table (the summary's figures that apply to the run), then the lines under it:
chaos events that did not fire, the summary's warnings, where the results are, where TensorBoard's
events are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from distrain.commands import console as consoles
from distrain.commands.run_display import short_strategy
from distrain.config import RunConfig
from distrain.config.layout_section import grid_text
from distrain.errors import DistrainError
from distrain.units import size_text


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def membership_row(summary: dict[str, Any]) -> tuple[str, str] | None:
    """The summary's line for an elastic run's membership over time."""
    m = summary.get("membership")
    if not m:
        return None
    return (
        "workers peak / final / joins / leaves",
        f"{m['peak_members']} / {m['final_members']} / {m['joins']} / {m['leaves']} "
        f"({m['samples_redone']:,} samples redone, {m['reform_s']:.1f} s setting up joiners)",
    )


def grid_of(summary: dict[str, Any]) -> str:
    """The workers as summary.json's `layout` says them (a summary written before it: N workers)."""
    return grid_text(summary.get("layout") or {"replicas": summary["workers"]})


def _best_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """--checkpoint-best: which evaluation checkpoints/best.pt holds."""
    best = summary.get("best_checkpoint")
    if not isinstance(best, dict):
        return []
    where = f"(epoch {best['epoch'] + 1}, {best['path']})"
    return [(f"best {best['metric'].replace('_', ' ')}", f"{_fmt(best['value'], '.4f')} {where}")]


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    table = Table(title=Text(f"distrain run {summary['run_id']}"), show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [] if summary.get("status") == "completed" else [("status", str(summary.get("status")))]
    rows += [
        ("strategy", f"{short_strategy(summary['strategy'])} x {grid_of(summary)}"),
        (
            ("model / data", f"{summary['model']} / {summary['dataset']}")
            if summary.get("task") in (None, "classification")
            else ("task", str(summary["task"]))
        ),
        ("epochs / steps", f"{summary['epochs_completed']} / {summary['steps_completed']}"),
        *[
            (f"final {key.removeprefix('final_').replace('_', ' ')}", _fmt(value, ".4f"))
            for key, value in summary.items()
            if key.startswith(("final_val_", "final_test_"))
        ],
        *_target_rows(summary),
        *_best_rows(summary),
        ("wall time", _fmt(summary["wall_time_s"], ".1f") + " s"),
        ("steady-state throughput", _fmt(summary["steady_state_samples_per_s"], ",.0f") + " samples/s"),
        ("sent per step (all workers)", _size(summary["bytes_per_step"])),
        (
            "mean compute / comm per step",
            f"{_fmt(summary['mean_compute_s'], '.4f')} / {_fmt(summary['mean_comm_s'], '.4f')} s",
        ),
    ]
    if "peak_memory_bytes" in summary:  # a summary written before the column: no row
        rows.append(("peak memory of a worker (host)", _size(summary["peak_memory_bytes"])))
    if "gpu_peak_bytes" in summary:
        rows.append(("peak memory of a worker (GPU)", _size(summary["gpu_peak_bytes"])))
    rows += _family_rows(summary, "traffic")  # the parameter server's staleness, blocked time, traffic
    rows += _straggler_rows(summary)
    elastic = membership_row(summary)
    if elastic is not None:
        rows.append(elastic)
    if summary.get("failures"):
        rows.append(
            (
                "failures survived / time lost / steps redone",
                f"{summary['failures']} / {_fmt(summary['time_lost_s'], '.1f')} s / {summary['updates_lost']}",
            )
        )
    if summary.get("nonfinite_steps"):
        rows.append(("steps with a non-finite loss or gradient", str(summary["nonfinite_steps"])))
    if summary.get("overflow_steps"):
        rows.append(("of which fp16 overflows (skipped, normal)", str(summary["overflow_steps"])))
    if summary.get("chaos"):  # --chaos: each event and the step it struck at
        fired = [f"{c['event']} at {c['fired_step']}" for c in summary["chaos"] if c["fired"]]
        rows.append(("faults injected (step)", ", ".join(fired) or "none"))
    rows += _family_rows(summary, "end")  # local SGD's rounds and τ
    if summary.get("phases"):
        rows.append(("schedule", ", ".join(f"{p['strategy']} from step {p['start_step']}" for p in summary["phases"])))
    for key, value in rows:
        table.add_row(key, value)
    consoles.out.print(table)
    for c in summary.get("chaos") or []:
        if not c["fired"]:
            consoles.out.print(f"--chaos {c['event']} did not fire: {c['reason']}", markup=False, highlight=False)
    for line in summary.get("warnings") or []:
        consoles.out.print(f"warning: {line}", markup=False, highlight=False)
    consoles.out.print(f"results in {run_dir}/ ({', '.join(_run_files(run_dir))})", markup=False, highlight=False)
    _print_tensorboard_line(run_dir)  # last: where --tensorboard wrote the run's events


def _family_rows(summary: dict[str, Any], place: str) -> list[tuple[str, str]]:
    """The closing rows the strategies' column families declare for this place (strategies/step_columns.py)."""
    from distrain.strategies.step_columns import STEP_COLUMN_FAMILIES

    families = [f for f in STEP_COLUMN_FAMILIES if f.closing_rows is not None and f.closing_place == place]
    return [row for family in families for row in family.closing_rows(summary)]  # type: ignore[misc]


def _run_files(run_dir: Path) -> list[str]:
    """What the closing line names: the run's files that exist (a diverged or early-stopped run may have
    no checkpoints/, a run that failed before its first evaluation no metrics.parquet)."""
    names = ("config.yaml", "metrics.parquet", "summary.json", "checkpoints/")
    return [name for name in names if (run_dir / name.rstrip("/")).exists()]


def tensorboard_line(run_dir: Path) -> str | None:
    """With --tensorboard DIR or --loggers tensorboard (as the run's config.yaml records them): where the
    run's event files are (DIR/<run id>/ or RUN_DIR/tensorboard/, as orchestrator/tensorboard.py writes
    them) and the command that shows them."""
    import importlib.util
    import shlex

    try:
        recorded = RunConfig.load_yaml(run_dir / "config.yaml")
    except (OSError, DistrainError):
        return None
    root = str(recorded.get("tensorboard") or "")
    if root:
        where = Path(root) / run_dir.name
    elif "tensorboard" in str(recorded.get("loggers") or ""):
        where, root = run_dir / "tensorboard", str(run_dir.parent)  # beside the other runs' in that folder
    else:
        return None
    line = f"TensorBoard events in {where}/; view with: tensorboard --logdir {shlex.quote(root)}"
    if importlib.util.find_spec("tensorboard") is None:  # distrain writes them without it (tensorboardX)
        line += " (the viewer: pip install tensorboard, or the tensorboard extra)"
    return line


def _print_tensorboard_line(run_dir: Path) -> None:
    line = tensorboard_line(run_dir)
    if line is not None:
        consoles.out.print(line, markup=False, highlight=False)


def _target_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Time to the run's target, or "not reached"; no row for a run without a target."""
    if "target" not in summary:
        return []
    seconds = summary.get("time_to_target_s")
    return [(f"time to {summary['target']}", "not reached" if seconds is None else f"{seconds:.1f} s")]


def _size(nbytes: float | None) -> str:
    """Bytes in human units ("680.0 kB"); summary.json keeps the raw count."""
    return "-" if nbytes is None else size_text(nbytes)


def _straggler_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if summary.get("stragglers"):
        flagged = ", ".join(
            f"{w} (step {d['first_detected_step']}{', to the end' if d['flagged_at_end'] else ''})"
            for w, d in summary["stragglers"].items()
        )
        rows.append(("stragglers detected (worker)", flagged))
    if summary.get("dropped_gradients") is not None:
        dropped = summary["dropped_gradients"]
        per_worker = " ".join(f"{w}:{n}" for w, n in dropped.items())
        # Across cut replicas (--fsdp) the shards' clients are replicas, and the shards decide together.
        agreed = summary.get("rounds_shards_disagree")
        whom = "" if agreed is None else ", by replica"
        rows.append((f"gradients dropped as late/duplicate{whom}", f"{sum(dropped.values())} ({per_worker})"))
        if agreed is not None:
            rows.append(("rounds the PS shards disagreed on", str(agreed)))
    if summary.get("backup_copies_issued") is not None:
        rows.append(
            (
                "portions re-executed (copies)",
                f"{summary['backup_copies_issued']} of {summary['backup_portions_issued']} handed out",
            )
        )
    return rows
