"""Plain BSP against backup tasks (or backup workers) under one straggler with a fixed delay, and where each
worker's time went (issue 32). Whichever distrain is imported is measured: run it once with main's tree and
once with a branch's (PYTHONPATH), interleaved, for an A/B at the same delay.

Per run, one JSON line: time to 0.95 val accuracy from the first step (as benchmarks/stragglers.py counts
it), epochs, milliseconds per round over the run, the scheduler's and shards' counters (chunks, portions,
copies, dropped), and per worker its rows, MB pushed and pulled, median and summed compute, comm and wait.

    python benchmarks/straggler_ab.py --delay 0.12 [--rounds 1] [--only plain tasks] [--slow 1,0]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import pandas as pd

import distrain
from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training

KINDS = {
    "plain": dict(strategy="bsp", transport="ps"),
    "tasks": dict(strategy="bsp", transport="ps", backup_tasks=True),
    "kofn": dict(strategy="bsp", transport="ps", backup_workers=1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay", type=float, required=True, help="seconds added to worker 1's every step")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--only", nargs="*", default=["plain", "tasks"], choices=list(KINDS))
    ap.add_argument("--slow", default="1", help="1: with the straggler, 0: without; 1,0 both")
    args = ap.parse_args()
    start_local_ray(8)
    tree = os.path.dirname(distrain.__file__)
    scratch = Path(tempfile.mkdtemp(prefix="straggler-ab-"))
    n = 0
    for _ in range(args.rounds):
        for name in args.only:
            for slow in (s == "1" for s in args.slow.split(",")):
                n += 1
                extra = dict(straggler=[f"1:{args.delay:.4f}"]) if slow else {}
                config = RunConfig(
                    workers=args.workers, batch_size=args.batch_size, epochs=20, target_accuracy=0.95, seed=0,
                    segment_steps=10, run_dir=str(scratch / f"run{n}"), **KINDS[name], **extra,
                )  # fmt: skip
                t0 = time.perf_counter()
                run = run_training(config)
                total = time.perf_counter() - t0
                print(json.dumps(figures(run.run_dir, tree, name, slow, total)), flush=True)


def figures(run_dir: Path, tree: str, name: str, slow: bool, total: float) -> dict:
    df = pd.read_parquet(run_dir / "metrics.parquet")
    steps, evals = df[df["kind"] == "step"], df[df["kind"] == "eval"].sort_values("wall_time")
    start = float((steps["wall_time"] - steps["compute_s"] - steps["comm_s"]).min())
    hit = evals[evals["val_accuracy"] >= 0.95]
    span = float(steps["wall_time"].max()) - start
    rounds = int(steps["step"].nunique())
    summary = json.loads((run_dir / "summary.json").read_text())
    per = {}
    for worker, rows in steps.groupby("worker"):
        per[int(worker)] = {
            "rows": len(rows),
            "mb_sent": round(rows["bytes_sent"].sum() / 1e6, 2),
            "mb_recv": round(rows["bytes_received"].sum() / 1e6, 2),
            "med_compute_ms": round(1e3 * rows["compute_s"].median(), 2),
            "compute": round(rows["compute_s"].sum(), 3),
            "comm": round(rows["comm_s"].sum(), 3),
            "wait": round(rows["wait_s"].fillna(0).sum(), 3),
            "copies": int(rows["backup"].fillna(False).astype(bool).sum()),
            "dropped": int(rows["dropped"].fillna(False).astype(bool).sum()),
        }
    return {
        "tree": tree,
        "name": name,
        "slow": slow,
        "t": float(hit["wall_time"].iloc[0]) - start if not hit.empty else None,
        "epoch": int(hit["epoch"].iloc[0]) + 1 if not hit.empty else None,
        "ms_per_round": round(1e3 * span / rounds, 2),
        "rounds": rounds,
        "total": round(total, 2),
        "load": os.getloadavg()[0],
        "backup": {k: v for k, v in summary.items() if k.startswith("backup_") or k == "dropped_gradients"},
        "per": per,
    }


if __name__ == "__main__":
    main()
