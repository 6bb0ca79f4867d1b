"""Communication-efficient training on the language-model example under an emulated slow network (issue 15).

    .venv/bin/python benchmarks/comm_efficient.py [--epochs 6] [--workers 2] [--bandwidth 100mbit]
        [--latency-ms 20] [--sync-every 50] [--target-epoch N] [--contenders bsp,bsp+bf16,...]

Every contender trains `examples/char_lm.py`'s CharLM (the same initial weights, samples and order) with
Adam lr 0.003 (DiLoCo's inner optimizer; its outer one is Nesterov SGD lr 0.7, momentum 0.9), the
same global batch, for --epochs epochs, evaluating after each, on one local Ray, one after the other,
each worker's link emulated at --bandwidth with --latency-ms per transfer (`--comm-bandwidth`,
`--comm-delay-ms`: a transfer of b bytes lasts at least latency + b / rate from its launch).

BSP runs first; its test loss after --target-epoch epochs (default: half the run) is the fixed
validation loss every contender, BSP included, is timed to: the wall time of its first evaluation at
or below it and the bytes each worker had sent by then (both from metrics.parquet). Reported: that
time and those bytes, the final test loss, the total bytes per worker and the run's wall time, and
the ratios against BSP.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = f"{ROOT / 'examples' / 'char_lm.py'}:CharLM"
TASK_ARGS = {"max_bytes": 300_000}

# name -> the strategy's settings (the run's other settings are shared); {H} is --sync-every
CONTENDERS = {
    "bsp": {"strategy": "bsp"},
    "bsp+bf16": {"strategy": "bsp", "compress": "bf16"},
    "bsp+int8": {"strategy": "bsp", "compress": "int8"},
    "bsp+powersgd4": {"strategy": "bsp", "compress": "powersgd:4"},
    "local-sgd": {"strategy": "local-sgd", "tau": "{H}"},
    "diloco": {"strategy": "diloco", "sync_every": "{H}"},
    "streaming": {"strategy": "diloco", "sync_every": "{H}", "fragments": 4, "overlap_steps": 5, "mix_alpha": 0.5},
    "diloco+int8": {"strategy": "diloco", "sync_every": "{H}", "compress": "int8"},
}


def settings(name: str, h: int) -> dict:
    return {k: (h if v == "{H}" else v) for k, v in CONTENDERS[name].items()}


def run(name: str, args: argparse.Namespace, root: Path) -> dict:
    import pandas as pd

    from distrain.config import RunConfig
    from distrain.orchestrator.run import run_training

    run_dir = root / name
    config = RunConfig(
        task=TASK, task_args=TASK_ARGS, workers=args.workers, batch_size=args.global_batch // args.workers,
        optimizer="adam", lr=0.003, lr_scaling="none", epochs=args.epochs, eval_every=1, seed=args.seed,
        comm_delay_ms=args.latency_ms, comm_bandwidth=args.bandwidth, run_dir=str(run_dir),
        **settings(name, args.sync_every),
    )  # fmt: skip
    t0 = time.perf_counter()
    summary = run_training(config).summary
    wall = time.perf_counter() - t0
    rows = pd.read_parquet(run_dir / "metrics.parquet")
    return {
        "name": name,
        "steps_rows": rows[rows["kind"] == "step"],
        "evals": rows[rows["kind"] == "eval"].sort_values("wall_time"),
        "final_loss": summary["final_test_loss"],
        "bytes_total": rows.loc[rows["kind"] == "step", "bytes_sent"].sum() / args.workers,
        "codec_ratio": summary.get("codec_ratio"),
        "wall": wall,
        "steps": summary["steps_completed"],
    }


def to_target(result: dict, target: float, workers: int) -> tuple[float | None, float | None]:
    """Wall time of the first evaluation at or below `target`, and the bytes per worker sent by then."""
    evals = result["evals"]
    hit = evals[evals["val_loss"] <= target]
    if hit.empty:
        return None, None
    t = float(hit["wall_time"].iloc[0])
    steps = result["steps_rows"]
    return t, float(steps.loc[steps["wall_time"] <= t, "bytes_sent"].sum()) / workers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-epoch", type=int, default=0, help="BSP's loss after this epoch is the target (0: half)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    args = ap.parse_args()
    names = [n.strip() for n in args.contenders.split(",")]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or names[0] != "bsp":
        raise SystemExit(f"--contenders: known {', '.join(CONTENDERS)}; bsp first (it sets the target); got {names}")

    import ray

    from distrain.orchestrator.cluster import start_local_ray

    start_local_ray(num_cpus=args.workers + 1)
    load = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results.append(run(name, args, Path(tmp)))
            print(f"{name}: final test loss {results[-1]['final_loss']:.4f}, {results[-1]['wall']:.1f} s", flush=True)
    ray.shutdown()
    target_epoch = args.target_epoch or max(1, args.epochs // 2)
    target = float(results[0]["evals"]["val_loss"].iloc[target_epoch - 1])
    for r in results:
        r["time_to_target"], r["bytes_to_target"] = to_target(r, target, args.workers)

    bsp = results[0]
    print(
        f"\nCharLM {TASK_ARGS}, {args.workers} workers, global batch {args.global_batch}, {args.epochs} epochs, "
        f"Adam lr 0.003; emulated link {args.bandwidth}, {args.latency_ms:g} ms per transfer; H = {args.sync_every}; "
        f"target: BSP's test loss after epoch {target_epoch}, {target:.4f}; load average (1 min) {load:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after\n"
    )
    print("| contender | time to target | vs BSP | MB/worker to it | fewer bytes than BSP | final test loss | "
          "vs BSP's | MB/worker in all | codec ratio | wall time | steps |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        t, b = r["time_to_target"], r["bytes_to_target"]
        ratio = f"{r['codec_ratio']:.1f}x" if r["codec_ratio"] else "-"
        sooner = f"{bsp['time_to_target'] / t:.1f}x sooner" if t else "not reached"
        fewer = f"{bsp['bytes_to_target'] / b:.0f}x" if b else "-"
        print(
            f"| {r['name']} | {f'{t:.1f} s' if t else '-'} | {sooner} | {f'{b / 1e6:.2f}' if b else '-'} | {fewer} | "
            f"{r['final_loss']:.4f} | {100 * (r['final_loss'] / bsp['final_loss'] - 1):+.1f} % | "
            f"{r['bytes_total'] / 1e6:.2f} | {ratio} | "
            f"{r['wall']:.1f} s | {r['steps']} |"
        )


if __name__ == "__main__":
    main()
