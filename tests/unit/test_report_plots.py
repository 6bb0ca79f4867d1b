"""`distrain report`'s plots on recorded run directories built here (config.yaml, summary.json and
metrics.parquet as a run writes them, with made-up figures): no Ray, seconds. What a reader sees: the
time axes start at each run's first step, log loss axes read 0.2 / 1 / 2, legends name no output-only
setting and cover no bar, and a full-batch (Sandblaster) run is reported with its passes plot.
tests/integration/test_report.py runs the same code on real runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.reporting.plots import (
    PLOTS,
    plot_accuracy,
    plot_bytes,
    plot_loss,
    plot_loss_vs_bytes,
    plot_loss_vs_passes,
    plot_staleness,
    plot_throughput,
    plot_time_split,
)
from distrain.reporting.report import load_runs, plot_runs, render

WORKERS = 2


def recorded_run(root: Path, name: str, start_up: float, *, ps: bool = False, full_batch: bool = False,
                 steps: int = 40, **settings) -> Path:  # fmt: skip
    """A run directory: `start_up` seconds before the first step, then `steps` global steps 0.1 s apart
    on two workers (full_batch: one row per worker per iteration, counting its data passes), an
    evaluation per epoch of 20 steps; under `ps`, staleness and blocked time."""
    run_dir = root / name
    run_dir.mkdir()
    config = RunConfig.resolve(None, {"run_dir": str(run_dir), **settings})
    (run_dir / "config.yaml").write_text(config.to_yaml())
    rows = []
    for step in range(steps):
        for worker in range(WORKERS):
            row = {
                "kind": "step", "step": step, "worker": worker, "epoch": step // 20,
                "loss": 0.2 + 2.0 * math.exp(-step / 10) + 0.01 * worker, "lr": 0.05, "samples": 32,
                "compute_s": 0.02, "comm_s": 0.01, "bytes_sent": 40_000,
                "wall_time": start_up + 0.1 * step + 0.01 * worker,
            }  # fmt: skip
            if ps:
                row |= {"wait_s": 0.004, "staleness": (step + worker) % 3}
            if full_batch:
                row |= {"data_passes": 2.0 * (step + 1)}
            rows.append(row)
        if step % 20 == 19:
            rows.append({
                "kind": "eval", "step": step + 1, "epoch": step // 20, "test_loss": 1.0 / (step + 1),
                "test_accuracy": 0.5 + step / 100, "wall_time": start_up + 0.1 * step + 0.05,
            })  # fmt: skip
    pd.DataFrame(rows).to_parquet(run_dir / "metrics.parquet")
    summary = {
        "run_id": name, "status": "completed", "strategy": config.strategy_name, "workers": WORKERS,
        "epochs_completed": steps // 20, "steps_completed": steps, "final_test_accuracy": 0.89,
        "target_accuracy": 0.95, "steady_state_samples_per_s": 640.0, "time_to_target_s": None,
    }  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    """BSP with TensorBoard events (15 s of start-up), async on the parameter server (40 s)."""
    return [
        recorded_run(tmp_path, "bsp", 15.0, tensorboard=str(tmp_path / "tb")),
        recorded_run(tmp_path, "async", 40.0, ps=True, strategy="async"),
    ]


def test_a_sandblaster_run_is_reported_with_its_passes_plot(tmp_path, runs):
    sand = recorded_run(tmp_path, "sand", 10.0, ps=True, full_batch=True, steps=20, strategy="sandblaster",
                        model="linear")  # fmt: skip
    files = render(load_runs([sand]))
    assert "loss_vs_passes.png" in files and "](loss_vs_passes.png)" in files["report.md"].decode()
    both = render(load_runs([*runs, sand]))
    text = both["report.md"].decode()
    for name in (n for n in PLOTS if n in both):
        assert f"]({name})" in text, name


def test_every_plot_has_a_caption():
    for name, plot in PLOTS.items():
        assert callable(plot.draw) and plot.caption.strip(), name


TIME_PLOTS = (plot_accuracy, plot_loss, plot_throughput, plot_bytes)


def test_time_axes_start_at_each_run_s_first_step(runs):
    """Start-up (15 s, 40 s) is not training: the 4 s each run trained fill the axis."""
    plotted = plot_runs(load_runs(runs))
    for plot in TIME_PLOTS:
        (ax, *_) = plot(plotted).axes
        left, right = ax.get_xlim()
        assert -0.5 < left <= 0.1 and right < 5.0, (plot.__name__, left, right)
        assert ax.get_xlabel() == "seconds since the run's first step"
    for run in plotted:
        steps = run.metrics[run.metrics["kind"] == "step"]
        assert steps["wall_time"].min() == 0.0


def tick_labels(axis) -> list[str]:
    axis.axes.figure.canvas.draw()
    return [t.get_text() for t in axis.get_ticklabels(which="both") if t.get_text()]


@pytest.mark.parametrize("plot", [plot_loss, plot_loss_vs_bytes, plot_loss_vs_passes])
def test_log_loss_ticks_are_plain_numbers(tmp_path, runs, plot):
    sand = recorded_run(tmp_path, "sand", 10.0, ps=True, full_batch=True, steps=20, strategy="sandblaster",
                        model="linear")  # fmt: skip
    (ax, *_) = plot(plot_runs(load_runs([*runs, sand]))).axes
    assert ax.get_yscale() == "log"
    labels = tick_labels(ax.yaxis)
    assert labels and all(float(t) > 0 for t in labels), labels  # "0.3", "1", "2": no 2×10⁰ mathtext
    assert not any("times" in t or "^" in t for t in labels), labels


def test_a_symlog_traffic_axis_has_plain_numbers_too(tmp_path, runs):
    light = recorded_run(tmp_path, "light", 5.0, strategy="local-sgd")
    m = pd.read_parquet(light / "metrics.parquet")
    m["bytes_sent"] = m["bytes_sent"] // 1000  # a thousandth of the others' traffic: a symlog axis
    m.to_parquet(light / "metrics.parquet")
    (ax,) = plot_loss_vs_bytes(plot_runs(load_runs([*runs, light]))).axes
    assert ax.get_xscale() == "symlog"
    labels = tick_labels(ax.xaxis)
    assert labels and all(t.replace(".", "").isdigit() for t in labels), labels


def test_legends_leave_out_output_only_settings(runs):
    fig = plot_loss(plot_runs(load_runs(runs)))
    texts = [t.get_text().replace("\n  ", " ") for t in fig.legends[0].get_texts()]
    assert texts == ["bsp: bsp", "async: async (ps) staleness-lr"], texts  # tensorboard and run_dir differ: unsaid


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("plot", [plot_time_split, plot_staleness])
def test_legends_cover_no_bar(runs, plot, tmp_path):
    ssp = recorded_run(tmp_path, "ssp", 20.0, ps=True, strategy="ssp")
    fig = plot(plot_runs(load_runs([*runs, ssp])))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends + [a.get_legend() for a in fig.axes if a.get_legend() is not None]
    box = legend.get_window_extent(renderer)
    bars = [p for ax in fig.axes for p in ax.patches if p.get_width() > 0 and p.get_height() > 0]
    assert len(bars) >= 3
    covered = [p for p in bars if overlaps(box, p.get_window_extent(renderer))]
    assert not covered, f"{len(covered)} bar(s) under the legend at {box}"


def test_the_smoothing_window_is_not_set_by_a_full_batch_run_s_few_iterations(tmp_path, runs):
    from distrain.reporting.plots import smoothing_window

    plotted = plot_runs(load_runs(runs))
    sand = recorded_run(tmp_path, "sand", 10.0, ps=True, full_batch=True, steps=5, strategy="sandblaster",
                        model="linear")  # fmt: skip
    assert smoothing_window(plotted) == smoothing_window(plot_runs(load_runs([*runs, sand]))) == 4
    assert np.isfinite(smoothing_window(plot_runs(load_runs([sand]))))
