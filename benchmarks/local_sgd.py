"""Local SGD and AdaComm against BSP: time to a training loss and to a test accuracy (issue 5).

Contenders: BSP (all-reduce every step), local SGD with τ = 4 and τ = 16, and AdaComm (τ_0 = 16,
re-chosen every --tau-interval). Each runs with `--comm-delay-ms` 20 (an emulated slow network: a
fixed sleep in every communication round) and with no delay. All runs are interleaved in one
invocation (the order flips every round) so machine load hits every contender alike.

Times are measured from the start of the first training step (the same actor start-up precedes
every contender and is left out): the time at which the worker-averaged training loss, smoothed
over one epoch of steps, first falls to each --loss, and the time of the first evaluation (every epoch)
at --target test accuracy. Each cell is the median over the rounds that reached it.

    python benchmarks/local_sgd.py [--rounds 2] [--epochs 12] [--loss 0.25 0.1] [--target 0.95]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import pandas as pd

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training

CONTENDERS = {
    "BSP": dict(strategy="bsp"),
    "local SGD τ=4": dict(strategy="local-sgd", tau=4),
    "local SGD τ=16": dict(strategy="local-sgd", tau=16),
    "AdaComm τ₀=16": dict(strategy="local-sgd", tau=16, adaptive_tau=True),
}


def times(run_dir: Path, losses: list[float], target: float) -> dict[str, float | None]:
    df = pd.read_parquet(run_dir / "metrics.parquet")
    steps = df[df["kind"] == "step"]
    evals = df[df["kind"] == "eval"].sort_values("wall_time")
    t0 = float((steps["wall_time"] - steps["compute_s"] - steps["comm_s"]).min())
    per_step = steps.groupby("step").agg(loss=("loss", "mean"), end=("wall_time", "max")).sort_index()
    spe = int(steps[steps["epoch"] == 0]["step"].nunique())
    smooth = per_step["loss"].rolling(spe).mean()
    reached = evals[evals["val_accuracy"] >= target]
    out: dict[str, float | None] = {}
    for loss in losses:
        below = per_step[smooth <= loss]
        out[f"loss_s {loss:g}"] = float(below["end"].iloc[0]) - t0 if not below.empty else None
    return out | {
        "acc_s": float(reached["wall_time"].iloc[0]) - t0 if not reached.empty else None,
        "train_s": float(per_step["end"].iloc[-1]) - t0,
        "final_acc": float(evals["test_accuracy"].iloc[-1]),
        "comm_s": float(steps.groupby("worker")["comm_s"].sum().mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--loss", type=float, nargs="+", default=[0.25, 0.1], help="training-loss thresholds")
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy threshold")
    ap.add_argument("--tau-interval", default="1s", help="AdaComm interval for the adaptive contender")
    args = ap.parse_args()
    start_local_ray(num_cpus=4)
    results: dict[tuple[int, str], list[dict]] = {}
    runs = [(delay, name) for delay in (20, 0) for name in CONTENDERS]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (delay, name) in enumerate(runs if r % 2 == 0 else runs[::-1]):
                kw = dict(CONTENDERS[name])
                if kw.get("adaptive_tau"):
                    kw["tau_interval"] = args.tau_interval
                config = RunConfig(
                    workers=2, epochs=args.epochs, comm_delay_ms=float(delay), seed=r,
                    target_accuracy=args.target, run_dir=f"{tmp}/r{r}-{i}", **kw,
                )  # fmt: skip
                result = run_training(config)
                t = times(result.run_dir, args.loss, args.target)
                t["rounds"] = result.summary.get("averaging_rounds") or result.summary["steps_completed"]
                t["tau"] = result.summary.get("tau_changes")
                results.setdefault((delay, name), []).append(t)
                print(f"round {r} delay {delay} ms {name}: {t}", flush=True)

    def med(values: list) -> float | None:
        """Median over the rounds that reached the threshold (how many did is shown beside it)."""
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    print()
    keys = [f"loss_s {loss:g}" for loss in args.loss] + ["acc_s"]
    heads = [f"time to train loss ≤ {loss:g} (s) | vs BSP" for loss in args.loss]
    heads.append(f"time to test acc ≥ {args.target:g} (s) | vs BSP")
    tail = "training time (s) | comm s / worker | averaging rounds | final acc"
    print(f"| delay | contender | {' | '.join(heads)} | {tail} |")
    print("|---:|---|" + "---:|---:|" * len(keys) + "---:|---:|---:|---:|")
    for delay in (20, 0):
        base = results[(delay, "BSP")]
        for name in CONTENDERS:
            rows = results[(delay, name)]
            cells = []
            for key in keys:
                m = med([x[key] for x in rows])
                b = med([x[key] for x in base])
                reached = sum(x[key] is not None for x in rows)
                text = "not reached" if m is None else f"{m:.2f}"
                if m is not None and reached < len(rows):
                    text += f" ({reached}/{len(rows)})"
                cells += [text, f"{b / m:.2f}×" if m and b else "–"]
            train = statistics.median(x["train_s"] for x in rows)
            comm = statistics.median(x["comm_s"] for x in rows)
            rnds = statistics.median(x["rounds"] for x in rows)
            acc = statistics.median(x["final_acc"] for x in rows)
            print(f"| {delay} ms | {name} | {' | '.join(cells)} | {train:.2f} | {comm:.2f} | {rnds:.0f} | {acc:.4f} |")
    print()
    for (delay, name), rows in results.items():
        if "AdaComm" in name:
            print(f"AdaComm τ changes at {delay} ms (step, τ), per round: {[x['tau'] for x in rows]}")


if __name__ == "__main__":
    main()
