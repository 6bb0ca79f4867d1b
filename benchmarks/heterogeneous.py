"""Heterogeneous workers, side by side in one invocation (issue 31).

Worker 1 of 2 computes 3x slower (`--straggler 1:x3`, its compute stretched, so a smaller share is
faster). Four contenders at the same global batch 2B and the same two actors:
- plain BSP (collective), equal shares: every step waits for the slow worker;
- backup workers (`--transport ps --workers 1 --backup-workers 1 --batch-size 2B`): each round applies
  the first gradient in, so the slow worker's are mostly dropped;
- static shares (`--worker-weights 3,1`): b = 1.5B and 0.5B, the speeds known in advance;
- speed-balanced BSP (`--balance speed`): the driver measures and moves the shares.
Reported per contender: `steady_state_samples_per_s` (summary.json) and the training time to a validation
accuracy (from the first step, one evaluation per epoch), medians over the rounds, interleaved.
Acceptance (issue 31): balanced >= 1.4x plain BSP's samples/s, time to target not behind backup workers.

    python benchmarks/heterogeneous.py [--rounds 2] [--batch-size 32] [--target 0.95] [--out FILE]

Run it on a quiet machine: every contender's speed is its slowest worker's, so load from other
processes moves the figures more than the contenders differ.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from stragglers import training_time_to_target  # this folder is sys.path[0] when run as a script

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training

SLOW = ["1:x3"]


def contenders(b: int) -> dict[str, dict]:
    return {
        "plain BSP": dict(workers=2, batch_size=b),
        "backup workers (ps, 1 + 1 backup)": dict(transport="ps", workers=1, backup_workers=1, batch_size=2 * b),
        "static shares 3,1": dict(workers=2, batch_size=b, worker_weights="3,1"),
        "speed-balanced": dict(workers=2, batch_size=b, balance="speed"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="also append the markdown table to this file")
    args = ap.parse_args()

    start_local_ray(4)
    scratch = Path(tempfile.mkdtemp(prefix="distrain-heterogeneous-"))
    rates: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {}
    shares: dict[str, list[int]] = {}
    t_all = time.perf_counter()
    n = 0
    for r in range(args.rounds):
        for name, kw in contenders(args.batch_size).items():
            n += 1
            config = RunConfig(
                epochs=args.epochs, target_accuracy=args.target, seed=r, segment_steps=10, straggler=SLOW,
                run_dir=str(scratch / f"run{n}"), **kw,
            )  # fmt: skip
            run = run_training(config)
            rate = run.summary.get("steady_state_samples_per_s")
            t, _ = training_time_to_target(run.run_dir, args.target)
            shares[name] = run.summary.get("worker_shares", [])
            print(f"round {r + 1}: {name:<34} {rate} samples/s, to {args.target}: {t} s {shares[name]}", flush=True)
            if rate:
                rates.setdefault(name, []).append(rate)
            if t is not None:
                times.setdefault(name, []).append(t)
    total = time.perf_counter() - t_all

    def med(values: dict[str, list[float]], name: str) -> float | None:
        return statistics.median(values[name]) if values.get(name) else None

    plain = med(rates, "plain BSP")
    lines = [
        f"Worker 1 of 2 computes 3x slower (--straggler 1:x3); global batch {2 * args.batch_size}; target validation "
        f"accuracy {args.target}; median of {args.rounds} round(s); {total:.0f} s in all.",
        "",
        "| contender | steady-state samples/s | vs plain BSP | time to target (s) | shares at the end |",
        "|---|---|---|---|---|",
    ]
    for name in contenders(args.batch_size):
        rate, t = med(rates, name), med(times, name)
        ratio = f"{rate / plain:.2f}x" if rate and plain else "-"
        lines.append(
            f"| {name} | {'-' if rate is None else f'{rate:,.0f}'} | {ratio} | "
            f"{'not reached' if t is None else f'{t:.1f}'} | {'/'.join(map(str, shares[name])) or '-'} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
