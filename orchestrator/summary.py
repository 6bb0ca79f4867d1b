"""Turn a run's metrics into its `summary.json` figures."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

WARMUP_FRACTION = 0.1  # share of global steps left out of the steady-state throughput


def steady_state_samples_per_s(steps: pd.DataFrame, evals: pd.DataFrame) -> float | None:
    """Samples/s over the global steps after the warm-up, evaluation pauses excluded.

    A global step ends when its last worker finishes it; the window runs from the end of the last
    warm-up step to the end of the last step.
    """
    if "dropped" in steps:  # late or duplicate gradients (backup workers / tasks) did no training
        steps = steps[steps["dropped"].ne(True)]
    if steps.empty:
        return None
    per_step = steps.groupby("step").agg(samples=("samples", "sum"), end=("wall_time", "max")).sort_index()
    if len(per_step) < 2:
        return None
    skip = max(1, int(len(per_step) * WARMUP_FRACTION))
    skip = min(skip, len(per_step) - 1)
    t_start = per_step["end"].iloc[skip - 1]
    t_end = per_step["end"].iloc[-1]
    window = per_step.iloc[skip:]
    paused = 0.0
    if not evals.empty:
        inside = evals[(evals["wall_time"] > t_start) & (evals["wall_time"] <= t_end)]
        paused = float(inside["eval_s"].sum())
    elapsed = t_end - t_start - paused
    return float(window["samples"].sum() / elapsed) if elapsed > 0 else None


def summarize(
    df: pd.DataFrame,
    config: dict[str, Any],
    started_at: float,
    wall_time_s: float,
    status: str,
    epochs_completed: int,
) -> dict[str, Any]:
    steps = df[df["kind"] == "step"]
    evals = df[df["kind"] == "eval"].sort_values("wall_time")
    target = config["target_accuracy"]
    reached = evals[evals["test_accuracy"] >= target]
    per_step_bytes = steps.groupby("step")["bytes_sent"].sum() if not steps.empty else pd.Series(dtype=float)

    def num(value: Any) -> float | None:
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

    return {
        "run_id": df["run_id"].iloc[0] if not df.empty else None,
        "status": status,
        "strategy": config["strategy"],
        "model": config["model"],
        "dataset": config["dataset"],
        "workers": config["workers"],
        "global_batch_size": config["workers"] * config["batch_size"],
        "epochs_completed": epochs_completed,
        "steps_completed": int(steps["step"].max()) + 1 if not steps.empty else 0,
        "final_test_accuracy": num(evals["test_accuracy"].iloc[-1]) if not evals.empty else None,
        "final_test_loss": num(evals["test_loss"].iloc[-1]) if not evals.empty else None,
        "best_test_accuracy": num(evals["test_accuracy"].max()) if not evals.empty else None,
        "target_accuracy": target,
        "time_to_target_s": num(reached["wall_time"].iloc[0]) if not reached.empty else None,
        "started_at": started_at,  # unix time the metrics' wall_time counts from
        "wall_time_s": wall_time_s,
        "steady_state_samples_per_s": steady_state_samples_per_s(steps, evals),
        # Bytes all workers together send per global step (by the transport's algorithmic count).
        "bytes_per_step": num(per_step_bytes.mean()) if not per_step_bytes.empty else None,
        "bytes_per_step_per_worker": num(steps["bytes_sent"].mean()) if not steps.empty else None,
        "mean_compute_s": num(steps["compute_s"].mean()) if not steps.empty else None,
        "mean_comm_s": num(steps["comm_s"].mean()) if not steps.empty else None,
        # Global steps in which some loss, gradient or average was not finite (--on-nonfinite).
        "nonfinite_steps": int(steps.loc[steps["nonfinite"].eq(True), "step"].nunique()) if "nonfinite" in steps else 0,
        **parameter_server_figures(steps),
        **local_sgd_figures(steps),
    }


def local_sgd_figures(steps: pd.DataFrame) -> dict[str, Any]:
    """Averaging rounds, bytes communicated and τ over time of a local SGD run (nulls otherwise)."""
    rows = steps.dropna(subset=["tau"]) if "tau" in steps else steps.iloc[0:0]
    if rows.empty:
        keys = ("averaging_rounds", "bytes_communicated", "tau_min", "tau_max", "tau_final", "tau_changes")
        return dict.fromkeys(keys)
    # τ is the same on every worker for a step (decided from all-reduced values): one value per step.
    per_step = rows.groupby("step")["tau"].first().sort_index().astype(int)
    changed = per_step[per_step.ne(per_step.shift())]
    return {
        "averaging_rounds": int(rows["averaging_round"].max()),
        "bytes_communicated": int(rows["bytes_sent"].sum()),  # all workers, over the local SGD steps
        "tau_min": int(per_step.min()),
        "tau_max": int(per_step.max()),
        "tau_final": int(per_step.iloc[-1]),
        "tau_changes": [[int(step), int(tau)] for step, tau in changed.items()],  # [first step, τ]
    }


def parameter_server_figures(steps: pd.DataFrame) -> dict[str, Any]:
    """Staleness, blocked time and traffic of a parameter-server run (nulls otherwise)."""
    ps = steps.dropna(subset=["staleness"]) if "staleness" in steps else steps.iloc[0:0]
    if ps.empty:
        keys = ("staleness_p50", "staleness_p95", "staleness_max", "wait_s_total", "wait_s_per_step")
        return dict.fromkeys(keys + ("bytes_pushed_per_step", "bytes_pulled_per_step"))
    staleness = ps["staleness"].astype(float)
    return {
        "staleness_p50": float(staleness.quantile(0.5)),
        "staleness_p95": float(staleness.quantile(0.95)),
        "staleness_max": int(staleness.max()),
        "wait_s_total": float(ps["wait_s"].sum()),  # summed over workers
        "wait_s_per_step": float(ps["wait_s"].mean()),  # per worker step
        "bytes_pushed_per_step": float(ps["bytes_sent"].mean()),  # per worker step
        "bytes_pulled_per_step": float(ps["bytes_received"].mean()),
    }
