"""The planner's predictions against measured runs (issue 17).

For each task: calibrate once (orchestrator/plan_calibrate.py: tiny runs at N=1 and 2, probes), then run
bsp over both transports, ssp(2), async, local-sgd(τ=8) and diloco(H=50) at N = 1, 2, 4 for --steps
steps each, and compare the predicted per-worker step time with the measured one (steady state: the
span of a worker's steps after the first quarter, over their count; median over workers). Runs are
interleaved (the strategy loop inside the worker-count loop) in one Ray session per task.

Calibration points are in-sample for bsp (collective) at N=1 and 2 and async at N=1: the table marks
them, and the median error is given with and without them.

    python benchmarks/plan_validation.py [--steps 60] [--tasks mlp,cnn] [--out /tmp/plan-validation]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray

from distrain.config import RunConfig
from distrain.orchestrator import cluster, planner
from distrain.orchestrator.plan_calibrate import calibrate, steady_figures
from distrain.orchestrator.run import run_training

STRATEGIES = [
    ("bsp", "collective", {}),
    ("bsp", "ps", {}),
    ("ssp", "ps", {"staleness": 2}),
    ("async", "ps", {}),
    ("local-sgd", "collective", {"tau": 8}),
    ("diloco", "collective", {"sync_every": 50}),
]
IN_SAMPLE = {("bsp", "collective", 1), ("bsp", "collective", 2), ("async", "ps", 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tasks", default="mlp,cnn")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="plan-validation-"))
    rows = []
    for model in args.tasks.split(","):
        base = RunConfig(model=model, dataset="digits", batch_size=32, epochs=100, lr=0.05, lr_scaling="none")
        cluster.start_local_ray(6)
        try:
            cal = calibrate(base, out / model, steps=24)
            for n in [int(x) for x in args.workers.split(",")]:
                for strategy, transport, settings in STRATEGIES:
                    run_dir = out / model / f"{strategy}-{transport}-{n}"
                    cfg = base.replace(
                        strategy=strategy, transport=transport, workers=n, max_steps=args.steps, eval_every=0,
                        run_dir=str(run_dir), **settings,
                    )  # fmt: skip
                    run_training(cfg)
                    measured = steady_figures(run_dir)["step_s"]
                    pred = planner.predict(cal, strategy, transport, n, settings=settings)
                    rows.append({
                        "task": f"{model}/digits", "strategy": strategy, "transport": transport, "workers": n,
                        "predicted_ms": pred.step_s * 1e3, "measured_ms": measured * 1e3,
                        "error": pred.step_s / measured - 1, "in_sample": (strategy, transport, n) in IN_SAMPLE,
                    })  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
            rows.append({"task": f"{model}/digits", "calibration": cal.to_dict()})
        finally:
            ray.shutdown()
    (out / "validation.json").write_text(json.dumps(rows, indent=2))
    table = [r for r in rows if "error" in r]
    print("| task | strategy | transport | N | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        mark = " (calibration)" if r["in_sample"] else ""
        print(f"| {r['task']} | {r['strategy']} | {r['transport']} | {r['workers']}{mark} | {r['predicted_ms']:.2f} | "
              f"{r['measured_ms']:.2f} | {r['error']:+.0%} |")  # fmt: skip
    all_err = statistics.median(abs(r["error"]) for r in table)
    out_err = statistics.median(abs(r["error"]) for r in table if not r["in_sample"])
    print(f"median |error|: {all_err:.0%} over all {len(table)} runs; {out_err:.0%} out of sample")
    print(f"files in {out}")


if __name__ == "__main__":
    main()
