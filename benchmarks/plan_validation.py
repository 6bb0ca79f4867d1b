"""The planner's predictions against measured runs (issue 17).

For each task: calibrate once (planning/calibrate.py: tiny runs at N=1 and 2 as long as the runs
they predict, `--steps`, so both are measured over the same window; probes), then run
bsp over both transports, ssp(2), async, local-sgd(τ=8) and diloco(H=50) at N = 1, 2, 4 for --steps
steps each, and compare the predicted per-worker step time with the measured one (steady state: the
span of a worker's steps after the first quarter, over their count; median over workers). Runs are
interleaved (the strategy loop inside the worker-count loop) in one Ray session per task.

Calibration points are in-sample for bsp (collective) at N=1 and 2 and async at N=1: the table marks
them, and the median error is given with and without them.

    python benchmarks/plan_validation.py [--steps 40] [--tasks mlp,cnn] [--workers 1,2,4] [--cpus 6] [--out DIR]
        [--strategies bsp-collective,bsp-ps,...] [--calibration-repeats 3]

On a quiet 16-core machine: `--cpus 16 --workers 1,2,4,8` (72 runs of actor start-up, a few seconds each:
about 4-6 minutes for the two tasks; `--calibration-repeats 1` or fewer `--strategies` make it shorter).
The script prints the load average before and after, and the time each task took.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray

from distrain.config import RunConfig
from distrain.orchestrator import cluster
from distrain.orchestrator.run import run_training
from distrain.orchestrator.run_checks import check_runnable
from distrain.planning import planner
from distrain.planning.calibrate import calibrate, fit, repeated_figures, steady_figures
from distrain.units import parse_worker_counts

STRATEGIES = [
    ("bsp", "collective", {}),
    ("bsp", "ps", {}),
    ("ssp", "ps", {"staleness": 2}),
    ("async", "ps", {}),
    ("local-sgd", "collective", {"tau": 8}),
    ("diloco", "collective", {"sync_every": 50}),
]
IN_SAMPLE = {("bsp", "collective", 1), ("bsp", "collective", 2), ("async", "ps", 1)}


def base_config(model: str) -> RunConfig:
    return RunConfig(model=model, dataset="digits", batch_size=32, epochs=100, lr=0.05, lr_scaling="none")


def strategy_name(strategy: str, transport: str) -> str:
    return f"{strategy}-{transport}"


def measure(
    out: Path, models: list[str], counts: list[int], steps: int, cpus: int, strategies: list, repeats: int
) -> None:
    """Calibrate, then run every strategy at every N (strategies interleaved within each N)."""
    for model in models:
        base = base_config(model)
        cluster.start_local_ray(cpus)
        t0 = time.time()
        try:
            calibrate(base, out / model, steps=steps, repeats=repeats)  # the same window as the runs below
            print(f"calibrated {model} in {time.time() - t0:.0f} s", flush=True)
            for n in counts:
                for strategy, transport, settings in strategies:
                    run_dir = out / model / f"{strategy}-{transport}-{n}"
                    cfg = base.replace(
                        strategy=strategy, transport=transport, workers=n, max_steps=steps, eval_every=0,
                        run_dir=str(run_dir), **settings,
                    )  # fmt: skip
                    run_training(cfg)
                    print(f"measured {model} {strategy} {transport} N={n}", flush=True)
        finally:
            ray.shutdown()
        print(f"{model}: {time.time() - t0:.0f} s", flush=True)


def evaluate(out: Path, models: list[str]) -> list[dict]:
    """Predicted against measured for every run directory there is, from the calibration refitted with
    the planner as it is now (calibrate.fit on the kept calibration runs and probe figures)."""
    rows = []
    for model in models:
        where = out / model / "calibration"
        probe = json.loads((where / "probe.json").read_text())
        base = base_config(model)
        cal = fit(base, where, check_runnable(base), probe)
        for strategy, transport, settings in STRATEGIES:
            for run_dir in sorted((out / model).glob(f"{strategy}-{transport}-*")):
                n = int(run_dir.name.rsplit("-", 1)[1])
                measured = steady_figures(run_dir)["step_s"]
                pred = planner.predict(cal, strategy, transport, n, settings=settings)
                rows.append({
                    "task": f"{model}/digits", "strategy": strategy, "transport": transport, "workers": n,
                    "predicted_ms": pred.step_s * 1e3, "measured_ms": measured * 1e3,
                    "error": pred.step_s / measured - 1, "in_sample": (strategy, transport, n) in IN_SAMPLE,
                })  # fmt: skip
        rows.append({"task": f"{model}/digits", "calibration": cal.to_dict()})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tasks", default="mlp,cnn")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cpus", type=int, default=6, help="the local Ray's num_cpus (16 on a 16-core machine)")
    ap.add_argument("--refit", action="store_true", help="no runs: evaluate the run directories in --out again")
    ap.add_argument("--strategies", default=",".join(strategy_name(s, t) for s, t, _ in STRATEGIES),
                    help="which of the six to run, e.g. bsp-collective,async-ps")  # fmt: skip
    ap.add_argument("--calibration-repeats", type=int, default=3, help="repeats of each calibration run (medians)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="plan-validation-"))
    models = args.tasks.split(",")
    known = {strategy_name(s, t): (s, t, o) for s, t, o in STRATEGIES}
    wanted = [x.strip() for x in args.strategies.split(",")]
    if unknown := [w for w in wanted if w not in known]:
        raise SystemExit(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    print(f"load average before: {os.getloadavg()} on {os.cpu_count()} cores; {time.strftime('%H:%M:%S')}")
    started = time.time()
    if not args.refit:
        counts = parse_worker_counts(args.workers)
        measure(out, models, counts, args.steps, args.cpus, [known[w] for w in wanted], args.calibration_repeats)
    rows = evaluate(out, models)
    (out / "validation.json").write_text(json.dumps(rows, indent=2))
    table = sorted((r for r in rows if "error" in r), key=lambda r: (r["task"], r["workers"]))
    print("| task | N | strategy | transport | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        mark = " (calibration)" if r["in_sample"] else ""
        print(f"| {r['task']} | {r['workers']} | {r['strategy']}{mark} | {r['transport']} | {r['predicted_ms']:.2f} | "
              f"{r['measured_ms']:.2f} | {r['error']:+.0%} |")  # fmt: skip
    all_err = statistics.median(abs(r["error"]) for r in table)
    out_err = statistics.median(abs(r["error"]) for r in table if not r["in_sample"])
    print(f"median |error|: {all_err:.0%} over all {len(table)} runs; {out_err:.0%} out of sample")
    # The noise floor: the calibration's runs are repeats of validation runs with the same config (minutes
    # apart, same steps); how far two measurements of one thing differ bounds what any model can reach.
    repeats = []
    for model in models:
        for calib, run in (("bsp-1", "bsp-collective-1"), ("bsp-2", "bsp-collective-2"), ("async-1", "async-ps-1")):
            a, b = out / model / "calibration", out / model / run
            if (list(a.glob(calib + "-r*")) or (a / calib).is_dir()) and b.is_dir():
                x, y = repeated_figures(a, calib)["step_s"], steady_figures(b)["step_s"]
                repeats.append(abs(x / y - 1))
                print(f"repeat {model} {run}: {x * 1e3:.2f} ms (calibration) vs {y * 1e3:.2f} ms ({x / y - 1:+.0%})")
    if repeats:
        print(f"median |difference| between repeats of one config: {statistics.median(repeats):.0%}")
    print(f"load average after: {os.getloadavg()}; {time.strftime('%H:%M:%S')}; {time.time() - started:.0f} s in all")
    print(f"files in {out}")


if __name__ == "__main__":
    main()
