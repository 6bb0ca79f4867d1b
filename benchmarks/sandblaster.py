"""Sandblaster (issue 20): passes and wall time to a fixed training loss, L-BFGS against SGD.

The convex task: multinomial logistic regression (`--model linear`) on the bundled digits, no
regularisation, so every contender's logged loss is the same quantity (the mean cross-entropy: the
full-batch objective for Sandblaster, minibatch means for SGD, smoothed here over one epoch of worker
steps). Contenders, each with --workers 4:
- Sandblaster L-BFGS (16 portions a pass, --backup-tasks);
- Downpour (async) SGD and BSP (all-reduce), each at the better of a small learning-rate grid
  (chosen without the straggler, then used with it);
each without and with one 4x straggler (worker 3 sleeps three times the measured compute time of its
unit: a minibatch step for SGD, a portion for Sandblaster). Optionally (--mlp) the same on the
two-layer MLP.

Passes: Sandblaster counts its gradient and line-search passes; an SGD run's step k of an epoch of S
steps has made (k + 1) / S passes. Time is from the first training step (actor start-up left out).

    python benchmarks/sandblaster.py [--target 0.15] [--out FILE] [--mlp | --models mlp]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pandas as pd

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training

WORKERS, STRAGGLER = 4, 3
LR_GRID = (0.1, 0.3, 1.0)


def config(model: str, run_dir: Path, **kw) -> RunConfig:
    return RunConfig(model=model, workers=WORKERS, seed=0, eval_every=1000, run_dir=str(run_dir), **kw)


def to_target(run_dir: Path, target: float) -> dict:
    """Passes and seconds (from the first step) until the training loss first reaches `target`."""
    df = pd.read_parquet(run_dir / "metrics.parquet")
    st = df[df["kind"] == "step"].sort_values("wall_time", kind="stable")
    summary = json.loads((run_dir / "summary.json").read_text())
    start = float((st["wall_time"] - st["compute_s"] - st["comm_s"]).min())
    if "data_passes" in st and st["data_passes"].notna().any():
        st = st.drop_duplicates("step")
        loss, passes = st["loss"], st["data_passes"].astype(float)
    else:
        spe = summary["steps_completed"] / summary["epochs_completed"]
        loss = st["loss"].rolling(int(spe * WORKERS), min_periods=1).mean()  # one epoch of worker steps
        passes = (st["step"].astype(float) + 1) / spe
    hit = loss <= target
    out = {"final_loss": float(loss.iloc[-1]), "final_test_accuracy": summary.get("final_test_accuracy"),
           "wall_s": float(st["wall_time"].iloc[-1]) - start, "passes": float(passes.iloc[-1])}  # fmt: skip
    if hit.any():
        i = hit.to_numpy().argmax()
        out |= {"passes_to_target": float(passes.iloc[i]), "seconds_to_target": float(st["wall_time"].iloc[i]) - start}
    return out


def median_compute(run_dir: Path) -> float:
    df = pd.read_parquet(run_dir / "metrics.parquet")
    st = df[df["kind"] == "step"]
    if "portions_done" in st and st["portions_done"].notna().any():  # per portion, not per iteration
        return float((st["compute_s"] - st["comm_s"]).sum() / st["portions_done"].sum())
    return float(st["compute_s"].median())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=float, default=0.15)
    parser.add_argument("--epochs", type=int, default=12, help="SGD epochs (passes)")
    parser.add_argument("--iterations", type=int, default=25, help="Sandblaster outer iterations")
    parser.add_argument("--mlp", action="store_true", help="also the two-layer MLP")
    parser.add_argument("--models", nargs="+", default=None, help="these models only (linear, mlp)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    start_local_ray(num_cpus=8)
    scratch = Path(tempfile.mkdtemp(prefix="sandblaster-bench-"))
    results: dict[str, dict] = {}
    for model in args.models or ["linear"] + (["mlp"] if args.mlp else []):
        sgd = {"async": dict(strategy="async"), "bsp": dict(strategy="bsp")}
        best: dict[str, float] = {}
        for name, kw in sgd.items():  # the learning rate, tuned without the straggler
            tried = {}
            for lr in LR_GRID:
                run = run_training(config(model, scratch / f"{model}-{name}-{lr}", epochs=args.epochs, lr=lr, **kw))
                tried[lr] = to_target(run.run_dir, args.target)
                results[f"{model} {name} lr={lr}"] = tried[lr]
            best[name] = min(tried, key=lambda lr: (tried[lr].get("seconds_to_target", 1e9), tried[lr]["final_loss"]))
        sb = dict(strategy="sandblaster", tasks_per_pass=16, backup_tasks=True, ps_shards=2, epochs=args.iterations)
        run = run_training(config(model, scratch / f"{model}-sandblaster", **sb))
        results[f"{model} sandblaster lbfgs"] = to_target(run.run_dir, args.target)
        portion_s = median_compute(run.run_dir)
        for name, kw in sgd.items():
            lr = best[name]
            probe = scratch / f"{model}-{name}-{lr}"
            delay = 3 * median_compute(probe)
            run = run_training(config(model, scratch / f"{model}-{name}-slow", epochs=args.epochs, lr=lr,
                                      straggler=[f"{STRAGGLER}:{delay}"], **kw))  # fmt: skip
            results[f"{model} {name} lr={lr} + 4x straggler"] = to_target(run.run_dir, args.target) | {"delay_s": delay}
        delay = 3 * portion_s
        slow = [f"{STRAGGLER}:{delay}"]
        run = run_training(config(model, scratch / f"{model}-sandblaster-slow", straggler=slow, **sb))
        results[f"{model} sandblaster lbfgs + 4x straggler"] = to_target(run.run_dir, args.target) | {
            "delay_s": delay, "backups_used": run.summary.get("backups_used"),
            "portions_reissued": run.summary.get("portions_reissued")}  # fmt: skip
    for name, r in results.items():
        print(f"{name:45s} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
