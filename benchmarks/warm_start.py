"""Warm workers and shards (orchestrator/warm_pool.py): how long a `distrain.fit` takes in a Ray session
that already ran one, with fresh processes against the previous run's warm ones, interleaved in one process.

Each round runs the same small fit twice: once with the pool turned off (`DISTRAIN_WARM_WORKERS=0`, every
worker a new process) and once taking the workers the previous run left (the pool primed before the
first round). With `--transport ps` a third run keeps the workers warm but starts fresh PS shards (as
before shards were kept: "warm-workers"). Reports each round's wall time of `fit` (driver call to
return), the medians and the ratios.

    python benchmarks/warm_start.py [--rounds 5] [--workers 2] [--epochs 1] [--transport ps --max-steps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import distrain
from distrain.orchestrator import warm_pool
from distrain.orchestrator.cluster import start_local_ray

RUN: dict = {}  # the fit's further arguments (--transport, --max-steps)
SHARDS_FRESH = False  # "warm-workers": the pool neither hands out nor keeps shards


def _take(node_id: str, kind: str = warm_pool.WORKER, _take=warm_pool.take):
    return None if SHARDS_FRESH and kind != warm_pool.WORKER else _take(node_id, kind)


def _keep(workers: list, nodes: list, kind: str = warm_pool.WORKER, _keep=warm_pool.keep):
    return [] if SHARDS_FRESH and kind != warm_pool.WORKER else _keep(workers, nodes, kind)


warm_pool.take, warm_pool.keep = _take, _keep  # (callers look them up in the module at each call)


def timed_fit(run_dir: str, workers: int, epochs: int) -> float:
    t0 = time.perf_counter()
    result = distrain.fit(workers=workers, epochs=epochs, run_dir=run_dir, progress=False, **RUN)
    assert result.status == "completed", result.status
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--transport", default=None, help="ps: also time warm workers with fresh shards")
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args()
    global SHARDS_FRESH
    RUN.update({k: v for k, v in (("transport", args.transport), ("max_steps", args.max_steps)) if v is not None})
    start_local_ray(num_cpus=max(4, 2 * args.workers + 2))
    modes = ("fresh", "warm", "warm-workers") if args.transport == "ps" else ("fresh", "warm")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as root:
        timed_fit(f"{root}/prime", args.workers, args.epochs)  # leaves the pool its workers
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                os.environ[warm_pool.WARM_ENV] = "0" if mode == "fresh" else str(warm_pool.DEFAULT_CAPACITY)
                SHARDS_FRESH = mode == "warm-workers"
                taken = warm_pool.taken()
                seconds = timed_fit(f"{root}/{mode}-{r}", args.workers, args.epochs)
                SHARDS_FRESH = False
                assert (warm_pool.taken() - taken == args.workers) == (mode != "fresh")
                times[mode].append(seconds)
                print(f"round {r} {mode:5s} {seconds:6.2f} s", flush=True)
                if mode == "fresh":  # a run with the pool off keeps nothing: prime it again for the warm one
                    os.environ[warm_pool.WARM_ENV] = str(warm_pool.DEFAULT_CAPACITY)
                    timed_fit(f"{root}/reprime-{r}", args.workers, args.epochs)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    print(f"\nfit, {args.workers} workers, {args.epochs} epoch(s), {RUN or 'defaults'}, median of {args.rounds}:")
    for mode, t in times.items():
        print(f"  {mode:13s} {median[mode]:6.2f} s  (range {min(t):.2f}-{max(t):.2f})")
    for mode in modes[1:]:
        print(f"  {mode} / fresh  {median[mode] / median['fresh']:6.3f}")
    if "warm-workers" in median:
        print(f"  warm / warm-workers  {median['warm'] / median['warm-workers']:6.3f}")


if __name__ == "__main__":
    main()
