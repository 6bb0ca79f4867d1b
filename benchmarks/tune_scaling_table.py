"""The batch-size x (LR scaling, warmup) table of a `distrain tune` sweep, as markdown (issue 6).

Reads sweep/<id>/results.parquet and each trial's metrics.parquet; one row per batch size, one column
per (lr_scaling, warmup_epochs) cell: final accuracy / time to target. Time to target is given two
ways: from the run's start (summary.json, includes starting the worker actors) and from the end of
the first training step (training only), since actor start-up dominates short runs on a busy machine.

    python benchmarks/tune_scaling_table.py sweep/<id>
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd


def training_time_to_target(run_dir: str, target: float) -> float | None:
    df = pd.read_parquet(Path(run_dir) / "metrics.parquet")
    steps, evals = df[df["kind"] == "step"], df[df["kind"] == "eval"].sort_values("wall_time")
    reached = evals[evals["val_accuracy"] >= target]
    if steps.empty or reached.empty:
        return None
    first_step_end = steps.groupby("step")["wall_time"].max().sort_index().iloc[0]
    return float(reached["wall_time"].iloc[0] - first_step_end)


def main(sweep_dir: str) -> None:
    results = pd.read_parquet(Path(sweep_dir) / "results.parquet")
    target = float(pd.read_json(Path(sweep_dir) / "sweep.json", typ="series")["base"]["target_accuracy"])
    results["train_ttt"] = [training_time_to_target(d, target) for d in results["run_dir"]]
    cells = sorted({(r, w) for r, w in zip(results["lr_scaling"], results["warmup_epochs"], strict=True)})
    head = " | ".join(f"{rule}, warmup {w:g}" for rule, w in cells)
    print(f"| batch/worker (global) | scaled lr | {head} |")
    print("|---|---|" + "---|" * len(cells))
    for bs in sorted(results["batch_size"].unique()):
        rows = results[results["batch_size"] == bs]
        lrs = "/".join(f"{x:g}" for x in sorted(rows["scaled_lr"].unique()))
        out = []
        for rule, w in cells:
            r = rows[(rows["lr_scaling"] == rule) & (rows["warmup_epochs"] == w)].iloc[0]
            ttt = "-" if pd.isna(r["time_to_target_s"]) else f"{r['time_to_target_s']:.1f}"
            train = "-" if r["train_ttt"] is None or pd.isna(r["train_ttt"]) else f"{r['train_ttt']:.1f}"
            out.append(f"{r['final_accuracy']:.4f} / {ttt} s ({train} s)")
        print(f"| {bs} ({bs * int(rows['workers'].iloc[0])}) | {lrs} | " + " | ".join(out) + " |")
    print(f"\nwall time of all trials' runs: {results['wall_time_s'].sum():.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
