"""The planner's --compress and emulated-network predictions against measured runs (issue 17).

mlp on digits at N=2, 40 steps each, on an emulated link (--comm-delay-ms, --comm-bandwidth) with and
without --compress int8; the prediction is the planner's, from a calibration of this machine (its tiny
runs run without codec or link) plus the run's own traffic figures (calibrate.traffic_figures).

    python benchmarks/plan_traffic_validation.py [--calibration /tmp/pv6/mlp/calibration] [--out DIR]

--calibration: the `calibration/` directory a plan_validation.py run kept (its tiny runs and probe.json);
without it, a calibration is made first (3 x 4 tiny runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import ray

from distrain.config import RunConfig
from distrain.orchestrator import cluster
from distrain.orchestrator.run import run_training
from distrain.orchestrator.run_checks import check_runnable
from distrain.planning import planner
from distrain.planning.calibrate import calibrate, fit, steady_figures, traffic_figures

CASES = [
    ("bsp", "collective", {"comm_delay_ms": 20.0}),
    ("bsp", "collective", {"comm_delay_ms": 5.0, "comm_bandwidth": "20mbit"}),
    ("bsp", "collective", {"comm_bandwidth": "10mbit"}),
    ("bsp", "collective", {"compress": "int8", "comm_bandwidth": "10mbit"}),
    ("local-sgd", "collective", {"tau": 8, "comm_delay_ms": 40.0}),
    ("async", "ps", {"comm_delay_ms": 20.0}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="plan-traffic-"))
    base = RunConfig(model="mlp", dataset="digits", batch_size=32, epochs=100, lr=0.05, lr_scaling="none")
    print(f"load average before: {os.getloadavg()}")
    cluster.start_local_ray(6)
    try:
        if args.calibration is None:
            cal0 = calibrate(base, out, steps=args.steps)
        else:
            probe = json.loads((args.calibration / "probe.json").read_text())
            cal0 = fit(base, args.calibration, check_runnable(base), probe)
        print("| run | predicted ms | measured ms | error | planned bytes/worker/step |")
        print("|---|---|---|---|---|")
        for i, (strategy, transport, extra) in enumerate(CASES):
            cfg = base.replace(strategy=strategy, transport=transport, workers=args.workers, max_steps=args.steps,
                               eval_every=0, run_dir=str(out / f"run{i}"), **extra)  # fmt: skip
            cal = dataclasses.replace(cal0, **traffic_figures(cfg, cal0.num_params))
            settings = {"tau": extra["tau"]} if "tau" in extra else None
            pred = planner.predict(cal, strategy, transport, args.workers, settings=settings)
            run_training(cfg)
            measured = steady_figures(Path(cfg.run_dir))["step_s"]
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in extra.items())
            print(f"| {strategy} ({transport}) N={args.workers} {flags} | {pred.step_s * 1e3:.1f} | "
                  f"{measured * 1e3:.1f} | {pred.step_s / measured - 1:+.0%} | {pred.bytes_per_worker:,.0f} |",
                  flush=True)  # fmt: skip
    finally:
        ray.shutdown()
    print(f"load average after: {os.getloadavg()}; files in {out}")


if __name__ == "__main__":
    main()
