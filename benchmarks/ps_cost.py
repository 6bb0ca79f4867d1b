"""Parameter-server costs, side by side in one invocation (issue 3).

Part 1, the floor: on the same Ray as everything else, measure one actor round trip (an empty call),
`ray.put` bandwidth for a buffer of the model's size, and an "echo" call that carries n bytes to an
actor and n bytes back doing no work. Then time one PS step: a push of n bytes and the pull of n bytes,
over K shards at once (the real `PSClient` against real `ParameterShard` actors, async rule, SGD with
momentum). Reported as ratios to the floor, for ~1e4, 1e6 and 1e7 parameters and K = 1, 2, 4.

Part 2, throughput: steady-state samples/s of async, SSP(2) and BSP over the PS against BSP
all-reduce, each with and without one straggler made 3x slower (a delay of twice the measured compute
time per step), all runs interleaved in one invocation.

    python benchmarks/ps_cost.py [--reps 100] [--rounds 1] [--workers 3] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training
from distrain.strategies.partition import partition
from distrain.strategies.ps_client import PSClient
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard


@ray.remote(num_cpus=0)
class Echo:
    def ping(self) -> int:
        return 0

    def echo(self, a: np.ndarray) -> np.ndarray:
        return a


def timed(fn, reps: int, warmup: int = 5) -> float:
    """Median seconds of `fn()` over `reps` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def floor_and_ps(reps: int) -> list[str]:
    echo = Echo.remote()
    ray.get(echo.ping.remote())
    rtt = timed(lambda: ray.get(echo.ping.remote()), reps * 2)
    lines = [
        f"One actor round trip (empty call): **{rtt * 1e3:.2f} ms**.",
        "",
        "| params | bytes | put MB/s | floor A: rtt + 2·n/put bw (ms) | floor B: echo n bytes there and back (ms) "
        "| PS step K=1 (ms) | K=2 | K=4 | ratio to floor A, K=1 / 2 / 4 | ratio to floor B, K=1 / 2 / 4 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in (10_000, 1_000_000, 10_000_000):
        x = np.random.default_rng(0).random(n, dtype=np.float32)
        r = max(5, reps // (1 if n <= 1_000_000 else 5))
        put = timed(lambda x=x: ray.put(x), r)
        floor = timed(lambda x=x: ray.get(echo.echo.remote(x)), r)
        formula = rtt + 2 * x.nbytes / (x.nbytes / put)
        step = {}
        for k in (1, 2, 4):
            bounds = partition(n, k)
            shards = [
                ray.remote(ParameterShard)
                .options(num_cpus=0, max_concurrency=64)
                .remote(i, 1, ConsistencyRule.asynchronous(), OptimizerSpec("sgd", 0.9, 0.0), x[a:b])
                for i, (a, b) in enumerate(bounds)
            ]
            client = PSClient(shards, bounds, worker=0)
            params = np.empty_like(x)
            client.pull(params)
            clock = iter(range(10**9))
            step[k] = timed(lambda c=client, p=params, x=x, it=clock: c.push_pull(next(it), x, 1e-6, p), r)
            for s in shards:
                ray.kill(s)
        lines.append(
            f"| {n:,} | {x.nbytes:,} | {x.nbytes / put / 1e6:,.0f} | {formula * 1e3:.2f} | {floor * 1e3:.2f} | "
            + " | ".join(f"{step[k] * 1e3:.2f}" for k in (1, 2, 4))
            + " | "
            + " / ".join(f"{step[k] / formula:.2f}×" for k in (1, 2, 4))
            + " | "
            + " / ".join(f"{step[k] / floor:.2f}×" for k in (1, 2, 4))
            + " |"
        )
    ray.kill(echo)
    return lines


def throughput(workers: int, rounds: int, epochs: int) -> list[str]:
    base = dict(workers=workers, epochs=epochs, segment_steps=25)
    contenders = {
        "bsp all-reduce": dict(strategy="bsp"),
        "bsp over PS (K=2)": dict(strategy="bsp", transport="ps", ps_shards=2),
        "ssp s=2 (K=2)": dict(strategy="ssp", staleness=2, ps_shards=2),
        "async (K=2)": dict(strategy="async", ps_shards=2),
    }
    # A 3x slower worker: its step takes its compute time plus a delay of twice that.
    with tempfile.TemporaryDirectory() as tmp:
        probe = run_training(RunConfig(run_dir=f"{tmp}/probe", **base, max_steps=60))
        compute = probe.summary["mean_compute_s"]
        delay = round(2 * compute, 4)
        results: dict[tuple[str, bool], list[float]] = {}
        accuracy: dict[tuple[str, bool], list[float]] = {}
        for rnd in range(rounds):
            for name, kw in contenders.items():
                for slow in (False, True):
                    extra = {"straggler": [f"{workers - 1}:{delay}"]} if slow else {}
                    run = run_training(
                        RunConfig(run_dir=f"{tmp}/{rnd}-{name}-{slow}".replace(" ", "_"), **base, **kw, **extra)
                    )
                    results.setdefault((name, slow), []).append(run.summary["steady_state_samples_per_s"])
                    accuracy.setdefault((name, slow), []).append(run.summary["final_test_accuracy"])
    ref = statistics.median(results[("bsp all-reduce", False)])
    lines = [
        f"{workers} workers, cnn on digits, {epochs} epochs, per-worker batch 32; straggler = worker {workers - 1} "
        f"with +{delay * 1e3:.1f} ms per step (2× its measured compute of {compute * 1e3:.1f} ms, i.e. 3× slower). "
        f"Median of {rounds} round(s).",
        "",
        "| strategy | samples/s | with straggler | kept | vs BSP all-reduce (no straggler) "
        "| final acc | with straggler |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in contenders:
        fast, slow = statistics.median(results[(name, False)]), statistics.median(results[(name, True)])
        acc_fast, acc_slow = statistics.median(accuracy[(name, False)]), statistics.median(accuracy[(name, True)])
        lines.append(
            f"| {name} | {fast:,.0f} | {slow:,.0f} | {slow / fast:.0%} | {fast / ref:.2f}× "
            f"| {acc_fast:.3f} | {acc_slow:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="append the markdown section to this file")
    args = parser.parse_args()
    start_local_ray(num_cpus=8)
    t0 = time.time()
    section = [
        "## Parameter-server costs (issue 3)",
        "",
        f"Command: `python benchmarks/ps_cost.py --reps {args.reps} --rounds {args.rounds} --workers {args.workers} "
        f"--epochs {args.epochs}` on 2 CPU cores, one local Ray (distrain's own start-up, RPC inlining up to 1 MiB).",
        "",
        "### Step cost against the floor",
        "",
        *floor_and_ps(args.reps),
        "",
        "### Throughput with and without a straggler",
        "",
        *throughput(args.workers, args.rounds, args.epochs),
        "",
        f"Benchmark wall time: {time.time() - t0:.0f} s.",
        "",
    ]
    text = "\n".join(section)
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + text)
    ray.shutdown()


if __name__ == "__main__":
    main()
