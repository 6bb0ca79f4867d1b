"""Turn a run's metrics into its `summary.json` figures."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from distrain.compression.spec import codec_figures
from distrain.config import Target, parse_workers
from distrain.config.layout_section import global_batch_of, layout_of
from distrain.orchestrator import outcome
from distrain.orchestrator.metrics import EVAL_PREFIXES
from distrain.orchestrator.throughput import SteadyState
from distrain.strategies.step_columns import STEP_COLUMN_FAMILIES


def steady_state_samples_per_s(steps: pd.DataFrame, evals: pd.DataFrame) -> float | None:
    """Samples/s over the global steps after the warm-up, evaluation pauses excluded (see throughput.py,
    whose definition the live progress display shares)."""
    meter = SteadyState()
    if not steps.empty:
        dropped = steps["dropped"].eq(True).tolist() if "dropped" in steps else None
        meter.add_steps(steps["step"].to_numpy(), steps["samples"].to_numpy(), steps["wall_time"].to_numpy(), dropped)
    for wall_time, eval_s in zip(evals.get("wall_time", []), evals.get("eval_s", []), strict=True):
        meter.add_eval(float(wall_time), None if pd.isna(eval_s) else float(eval_s))
    return meter.samples_per_s()


def summarize(
    df: pd.DataFrame,
    config: dict[str, Any],
    started_at: float,
    wall_time_s: float,
    status: str,
    epochs_completed: int,
    target: Target | None = None,
) -> dict[str, Any]:
    """The run's figures. A key is written only where it applies to the run (its strategy, task and
    settings: no parameter-server figures without a parameter server, no accuracy for a task that has none, no
    target figures without a target); a key that applies may be null where null means something
    (a target not reached, a figure not measurable yet, a test figure that was not finite)."""
    steps = df[df["kind"] == "step"]
    # In training order: two evaluations can finish out of order (that of step 24 recorded after step 32's),
    # and "final" is the last step's.
    evals = df[df["kind"] == "eval"].sort_values(["step", "wall_time"], kind="stable", na_position="first")
    builtin = not config.get("task")
    always = {"val_loss", "test_loss"} | ({"val_accuracy", "test_accuracy"} if builtin else set())
    metric_columns = [
        c
        for c in df.columns
        if c.startswith(EVAL_PREFIXES) and (c in always or evals[c].notna().any())
    ]
    reached = pd.DataFrame()
    if target is not None and target.metric in evals:
        reached = evals[[target.reached(v) for v in evals[target.metric]]]
    per_step_bytes = steps.groupby("step")["bytes_sent"].sum() if not steps.empty else pd.Series(dtype=float)

    def num(value: Any) -> float | None:
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

    low, high = parse_workers(config["workers"])
    slots = high or low  # an elastic run's step is cut into MAX slices
    summary: dict[str, Any] = {
        "run_id": df["run_id"].iloc[0] if not df.empty else Path(config.get("run_dir") or "").name or None,
        "status": status,
        "strategy": config["strategy"],
        "task": config.get("task") or "classification",
    }
    if builtin:  # a user's task brings its own model and data
        summary |= {"model": config["model"], "dataset": config["dataset"]}
    summary |= {
        "workers": config["workers"],  # N, or an elastic run's "MIN..MAX" (its membership: `elastic`)
        "layout": layout_of(config, slots),
        "global_batch_size": global_batch_of(config, slots),
        "epochs_completed": epochs_completed,
        "steps_completed": int(steps["step"].max()) + 1 if not steps.empty else 0,
        # final_val_<name> (the last evaluation, on the validation split) and final_test_<name> (the test set,
        # scored with the last evaluation): the loss, classification's accuracy, and every task metric
        **{f"final_{c}": (num(evals[c].iloc[-1]) if not evals.empty else None) for c in metric_columns},
    }
    if builtin:
        for split in ("val", "test"):  # a run recorded before the validation split has no val_ columns
            column = f"{split}_accuracy"
            if column in evals:
                summary[f"best_{column}"] = num(evals[column].max()) if not evals.empty else None
    if target is not None:
        summary["target"] = str(target)
        if builtin:
            summary["target_accuracy"] = config["target_accuracy"]
        summary["time_to_target_s"] = num(reached["wall_time"].min()) if not reached.empty else None  # None: missed
    summary |= {
        "started_at": started_at,  # unix time the metrics' wall_time counts from
        "wall_time_s": wall_time_s,
        "steady_state_samples_per_s": steady_state_samples_per_s(steps, evals),
        # Bytes all workers together send per global step (by the transport's algorithmic count).
        "bytes_per_step": num(per_step_bytes.mean()) if not per_step_bytes.empty else None,
        "bytes_per_step_per_worker": num(steps["bytes_sent"].mean()) if not steps.empty else None,
        "mean_compute_s": num(steps["compute_s"].mean()) if not steps.empty else None,
        "mean_comm_s": num(steps["comm_s"].mean()) if not steps.empty else None,
        # Global steps in which some loss, gradient or average was not finite (--on-nonfinite), fp16's
        # loss-scale overflows included (those alone: `overflow_steps`).
        "nonfinite_steps": _steps_where(steps, "nonfinite"),
    }
    summary |= peak_memory_figures(steps)
    if config.get("precision") == "fp16":
        summary["overflow_steps"] = _steps_where(steps, "overflow")
    summary |= family_figures(steps)
    summary |= codec_figures(steps, config)
    summary["warnings"] = outcome.warnings(evals)  # lines the CLI prints under the table; the status stays
    return summary


def _steps_where(steps: pd.DataFrame, column: str) -> int:
    """Global steps with some row whose `column` (a bool) is true."""
    return int(steps.loc[steps[column].eq(True), "step"].nunique()) if column in steps else 0


# step-row column (orchestrator/peak_memory.py) -> its summary key
PEAK_FIGURES = {"mem_peak_bytes": "peak_memory_bytes", "gpu_peak_bytes": "gpu_peak_bytes"}


def peak_memory_figures(steps: pd.DataFrame) -> dict[str, Any]:
    """The largest peak memory of any worker (`peak_memory_bytes`: host; `gpu_peak_bytes`: CUDA, GPU runs
    only) and each worker's own (`..._per_worker`, by rank). A column with no values (the GPU's on the
    CPU, rows recorded before the columns existed) writes no keys."""
    figures: dict[str, Any] = {}
    for column, key in PEAK_FIGURES.items():
        rows = steps.dropna(subset=[column]) if column in steps else steps.iloc[:0]
        if rows.empty:
            continue
        per_worker = rows.groupby("worker")[column].max()
        figures[key] = int(per_worker.max())
        figures[f"{key}_per_worker"] = {str(int(w)): int(v) for w, v in per_worker.items()}
    return figures


def family_figures(steps: pd.DataFrame) -> dict[str, Any]:
    """The figures of each strategy column family (strategies/step_columns.py) whose key column has rows
    in this run: the parameter server's staleness, local SGD's τ; nothing for a family the run never used."""
    figures: dict[str, Any] = {}
    for family in STEP_COLUMN_FAMILIES:
        if family.figures is None or family.key not in steps:
            continue
        rows = steps.dropna(subset=[family.key])
        if not rows.empty:
            figures |= family.figures(rows)
    return figures
