"""Straggler mitigation, side by side in one invocation (issue 4).

One worker of four is made 4x slower: a delay of three times the measured per-step compute time is
added to its every step. Time to a fixed test accuracy for plain BSP (over the PS), BSP with one
backup worker (k-of-n), BSP with backup tasks, and async, each with and without the straggler; all
runs interleaved round by round, on one Ray started once.

Time to target is counted from the first training step (actor start-up and data loading left out,
since they differ with the number of actors), at the resolution of one evaluation per epoch.

    python benchmarks/stragglers.py [--rounds 2] [--workers 4] [--batch-size 32] [--target 0.95] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training

STRAGGLER = 1
CONTENDERS = {
    "plain BSP": dict(strategy="bsp", transport="ps"),
    "BSP + 1 backup worker": dict(strategy="bsp", transport="ps", backup_workers=1),
    "BSP + backup tasks": dict(strategy="bsp", transport="ps", backup_tasks=True),
    "async": dict(strategy="async"),
}


def base(args: argparse.Namespace, run_dir: Path, **kw) -> RunConfig:
    return RunConfig(
        workers=args.workers, batch_size=args.batch_size, epochs=20, target_accuracy=args.target, seed=0,
        segment_steps=10, run_dir=str(run_dir), **kw,
    )  # fmt: skip


def training_time_to_target(run_dir: Path, target: float) -> tuple[float | None, int | None]:
    """Seconds from the start of the first step to the first evaluation at >= target, and its epoch."""
    df = pd.read_parquet(run_dir / "metrics.parquet")
    steps, evals = df[df["kind"] == "step"], df[df["kind"] == "eval"].sort_values("wall_time")
    start = float((steps["wall_time"] - steps["compute_s"] - steps["comm_s"]).min())
    hit = evals[evals["val_accuracy"] >= target]
    if hit.empty:
        return None, None
    return float(hit["wall_time"].iloc[0]) - start, int(hit["epoch"].iloc[0]) + 1


def measured_compute_s(args: argparse.Namespace, scratch: Path) -> float:
    """Median per-step compute time of a worker in the plain setting (no delay)."""
    run = run_training(base(args, scratch / "probe", strategy="bsp", transport="ps", max_steps=60))
    df = pd.read_parquet(run.run_dir / "metrics.parquet")
    return float(df[df["kind"] == "step"]["compute_s"].median())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None, help="also append the markdown table to this file")
    args = ap.parse_args()

    start_local_ray(8)
    scratch = Path(tempfile.mkdtemp(prefix="distrain-stragglers-"))
    compute = measured_compute_s(args, scratch)
    delay = 3 * compute  # the straggler's step takes 4x the others'
    print(f"median compute per step {compute * 1e3:.1f} ms -> straggler delay {delay * 1e3:.1f} ms", flush=True)

    times: dict[tuple[str, bool], list[float]] = {}
    epochs: dict[tuple[str, bool], list[int]] = {}
    t_all = time.perf_counter()
    n = 0
    for r in range(args.rounds):
        for name, kw in CONTENDERS.items():
            for slow in (True, False):
                n += 1
                extra = dict(straggler=[f"{STRAGGLER}:{delay:.4f}"]) if slow else {}
                run = run_training(base(args, scratch / f"run{n}", **kw, **extra))
                t, epoch = training_time_to_target(run.run_dir, args.target)
                label = "straggler" if slow else "no straggler"
                print(f"round {r + 1}: {name:<22} {label:<12} time to {args.target}: {t} s (epoch {epoch})", flush=True)
                if t is not None:
                    times.setdefault((name, slow), []).append(t)
                    epochs.setdefault((name, slow), []).append(epoch or 0)
    total = time.perf_counter() - t_all

    def med(key: tuple[str, bool]) -> float | None:
        return statistics.median(times[key]) if times.get(key) else None

    plain = med(("plain BSP", True))
    lines = [
        f"Straggler: worker {STRAGGLER} of {args.workers} (B={args.batch_size}), +{delay * 1e3:.1f} ms per step"
        f" (compute {compute * 1e3:.1f} ms:"
        f" 4x slower). Target val accuracy {args.target}; median of {args.rounds} round(s); {total:.0f} s in all.",
        "",
        "| contender | time to target, straggler (s) | no straggler (s) | speed-up vs plain BSP with straggler"
        " | slowdown from the straggler | epochs to target (straggler) |",
        "|---|---|---|---|---|---|",
    ]
    for name in CONTENDERS:
        slow, fast = med((name, True)), med((name, False))
        speedup = f"{plain / slow:.2f}x" if plain and slow else "-"
        slowdown = f"{slow / fast:.2f}x" if slow and fast else "-"
        ep = statistics.median(epochs[(name, True)]) if epochs.get((name, True)) else "-"
        fmt = lambda v: "not reached" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {name} | {fmt(slow)} | {fmt(fast)} | {speedup} | {slowdown} | {ep} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
