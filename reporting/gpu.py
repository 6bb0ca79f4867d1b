"""`distrain report`: the GPU figures of runs whose workers trained on CUDA devices, from their step rows:
NVML's utilisation and memory in use (`gpu_util`, `gpu_mem_bytes`: orchestrator/gpu_stats.py, with the
`gpu` extra), torch's peak allocated (`gpu_peak_bytes`: orchestrator/peak_memory.py) and the batch's
host-to-device copy (`h2d_s`). Runs without any GPU figure (the CPU's, or runs recorded before the columns)
get no row; with none at all, no table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

from distrain.reporting.markdown import markdown_table
from distrain.units import size_text

if TYPE_CHECKING:
    from distrain.reporting.report import Run

COLUMNS = ["run", "GPU utilisation (mean %)", "GPU memory in use (max)", "GPU peak allocated (max)", "h2d ms/step"]
GPU_FIGURES = ("gpu_util", "gpu_mem_bytes", "gpu_peak_bytes")


def _values(steps: pd.DataFrame, column: str) -> pd.Series:
    return steps[column].dropna() if column in steps else pd.Series(dtype=float)


def gpu_rows(runs: Sequence[Run]) -> list[list[str]]:
    rows = []
    for run in runs:
        metrics = run.metrics
        steps = metrics[metrics["kind"] == "step"] if "kind" in metrics else metrics.iloc[:0]
        util, used, peak, h2d = (_values(steps, c) for c in (*GPU_FIGURES, "h2d_s"))
        if util.empty and used.empty and peak.empty:
            continue
        rows.append([
            run.label,
            f"{util.mean():.0f}" if not util.empty else "-",
            size_text(float(used.max())) if not used.empty else "-",
            size_text(float(peak.max())) if not peak.empty else "-",
            f"{h2d.mean() * 1e3:.3f}" if not h2d.empty else "-",
        ])  # fmt: skip
    return rows


def gpu_section(runs: Sequence[Run]) -> str:
    rows = gpu_rows(runs)
    if not rows:
        return ""
    return (
        "## GPUs\n\nOver every worker's step rows: NVML's utilisation of the worker's GPU (the share of time a "
        "kernel ran, read about once a second) and the device memory in use (every process's), torch's peak "
        "allocated to tensors, and the mean time to move a step's batch to the device.\n\n"
        + markdown_table(rows, COLUMNS, numeric_from=1)
        + "\n"
    )
