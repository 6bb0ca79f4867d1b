"""Warm workers (orchestrator/warm_pool.py): how long a `distrain.fit` takes in a Ray session that already
ran one, with fresh worker processes against the previous run's warm ones, interleaved in one process.

Each round runs the same small fit twice: once with the pool turned off (`DISTRAIN_WARM_WORKERS=0`, every
worker a new process) and once taking the workers the previous run left (the pool primed before the
first round). Reports each round's wall time of `fit` (driver call to return), the median and the ratio.

    python benchmarks/warm_start.py [--rounds 5] [--workers 2] [--epochs 1]
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


def timed_fit(run_dir: str, workers: int, epochs: int) -> float:
    t0 = time.perf_counter()
    result = distrain.fit(workers=workers, epochs=epochs, run_dir=run_dir, progress=False)
    assert result.status == "completed", result.status
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    start_local_ray(num_cpus=max(4, 2 * args.workers))
    times: dict[str, list[float]] = {"fresh": [], "warm": []}
    with tempfile.TemporaryDirectory() as root:
        timed_fit(f"{root}/prime", args.workers, args.epochs)  # leaves the pool its workers
        for r in range(args.rounds):
            for mode in ("fresh", "warm") if r % 2 == 0 else ("warm", "fresh"):
                os.environ[warm_pool.WARM_ENV] = "0" if mode == "fresh" else str(warm_pool.DEFAULT_CAPACITY)
                taken = warm_pool.taken()
                seconds = timed_fit(f"{root}/{mode}-{r}", args.workers, args.epochs)
                assert (warm_pool.taken() - taken == args.workers) == (mode == "warm")
                times[mode].append(seconds)
                print(f"round {r} {mode:5s} {seconds:6.2f} s", flush=True)
                if mode == "fresh":  # a run with the pool off keeps nothing: prime it again for the warm one
                    os.environ[warm_pool.WARM_ENV] = str(warm_pool.DEFAULT_CAPACITY)
                    timed_fit(f"{root}/reprime-{r}", args.workers, args.epochs)
    fresh, warm = statistics.median(times["fresh"]), statistics.median(times["warm"])
    print(f"\nfit, {args.workers} workers, {args.epochs} epoch(s), median of {args.rounds}:")
    print(f"  fresh workers {fresh:6.2f} s  (range {min(times['fresh']):.2f}-{max(times['fresh']):.2f})")
    print(f"  warm workers  {warm:6.2f} s  (range {min(times['warm']):.2f}-{max(times['warm']):.2f})")
    print(f"  warm / fresh  {warm / fresh:6.3f}")


if __name__ == "__main__":
    main()
