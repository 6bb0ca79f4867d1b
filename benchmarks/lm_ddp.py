"""The language-model example under distrain BSP against the same model under torchrun DDP (issue 14).

    .venv/bin/python benchmarks/lm_ddp.py [--rounds 3] [--steps 200] [--global-batch 32] [--workers 2]

Both contenders train `examples/char_lm.py`'s CharLM (same task arguments, the same initial weights
from the same seed, Adam lr 0.003 with no LR scaling) on the same samples in the same order
(distrain's `EpochSharder`), read through distrain's `BatchReader` with prefetch, for the same number
of global steps, with 1 torch thread per worker process:

  distrain   `run_training(RunConfig(task=..., strategy="bsp", workers=W))` in-process on a Ray started
             once; samples/s is summary.json's steady-state figure (first 10 % of steps excluded)
  torchrun   `python -m torch.distributed.run --standalone --nproc-per-node W` running this file with
             --ddp-worker: DistributedDataParallel over gloo; samples/s over the same steps

Rounds alternate (distrain, torchrun, distrain, ...); the table gives the median and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = f"{ROOT / 'examples' / 'char_lm.py'}:CharLM"
TASK_ARGS = {"max_bytes": 300_000}
LR = 0.003
WARMUP = 0.1  # share of the steps left out of samples/s (as distrain's steady-state figure does)
BREAKDOWN: dict[str, list[str]] = {}  # contender -> per-round medians of its step's phases


def ddp_worker(args: argparse.Namespace) -> None:
    """One torchrun rank: the example's model in DDP, its loss, Adam, this rank's slice of each batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distrain.orchestrator.tasks import task_class
    from distrain.trainers.models import seeded
    from distrain.trainers.sharding import EpochSharder
    from distrain.trainers.task import BatchReader

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    task = task_class(TASK)(**TASK_ARGS)
    # the samples distrain trains on: the training set less its validation split (--val-fraction's default)
    from distrain.config import RunConfig
    from distrain.trainers.splits import task_splits

    train = task_splits(task, RunConfig().val_fraction).train
    model = DistributedDataParallel(seeded(task.build_model, args.seed))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    sharder = EpochSharder(len(train), args.global_batch, args.seed)
    reader = BatchReader(train, task.collate, prefetch=True)
    ends, phases = [], []
    for g in range(args.steps):
        t0 = time.perf_counter()
        epoch, step = divmod(g, sharder.steps_per_epoch)
        batch = reader.read(sharder.worker_indices(epoch, step, rank, world))
        if g + 1 < args.steps:
            nxt = divmod(g + 1, sharder.steps_per_epoch)
            reader.prefetch(sharder.worker_indices(nxt[0], nxt[1], rank, world))
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        task.loss(model, batch).backward()  # DDP's all-reduce runs inside, overlapped with backward
        t2 = time.perf_counter()
        optimizer.step()
        ends.append(time.perf_counter())
        phases.append((t1 - t0, t2 - t1, ends[-1] - t2))
    first = int(args.steps * WARMUP)
    rate = (args.steps - 1 - first) * args.global_batch / (ends[-1] - ends[first])
    if rank == 0:
        medians = [statistics.median(p[i] for p in phases[first:]) * 1000 for i in range(3)]
        Path(args.out).write_text(json.dumps({"samples_per_s": rate, "data_ms": medians[0],
                                              "fwd_bwd_comm_ms": medians[1], "opt_ms": medians[2]}))  # fmt: skip
    dist.destroy_process_group()


def run_torchrun(args: argparse.Namespace, out: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.workers}",
           __file__, "--ddp-worker", "--out", str(out), "--steps", str(args.steps),
           "--global-batch", str(args.global_batch), "--seed", str(args.seed)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT.parent)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"torchrun failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    BREAKDOWN.setdefault("torchrun DDP", []).append(
        f"data {result['data_ms']:.2f} ms, forward+backward (all-reduce inside) {result['fwd_bwd_comm_ms']:.2f} ms, "
        f"optimizer {result['opt_ms']:.2f} ms"
    )
    return result["samples_per_s"]


def run_distrain(args: argparse.Namespace, run_dir: Path) -> float:
    from distrain.config import RunConfig
    from distrain.orchestrator.run import run_training

    cfg = RunConfig(
        task=TASK, task_args=TASK_ARGS, strategy="bsp", workers=args.workers,
        batch_size=args.global_batch // args.workers, optimizer="adam", lr=LR, lr_scaling="none", epochs=100,
        max_steps=args.steps, eval_every=0, seed=args.seed, segment_steps=20, run_dir=str(run_dir),
    )  # fmt: skip
    import pandas as pd

    summary = run_training(cfg).summary
    steps = pd.read_parquet(run_dir / "metrics.parquet").query("kind == 'step'")
    steps = steps[steps["step"] >= int(args.steps * WARMUP)]
    gap = steps.sort_values("wall_time").groupby("worker")["wall_time"].diff().median() * 1000
    BREAKDOWN.setdefault("distrain BSP", []).append(
        f"compute (data+forward+backward) {steps['compute_s'].median() * 1000:.2f} ms, "
        f"all-reduce wait after backward {steps['comm_s'].median() * 1000:.2f} ms, step-to-step {gap:.2f} ms "
        "(the rest: the optimizer step and the loop's bookkeeping)"
    )
    return float(summary["steady_state_samples_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ddp_worker:
        return ddp_worker(args)
    import ray

    from distrain.orchestrator.cluster import start_local_ray

    start_local_ray(num_cpus=args.workers + 1)
    rates: dict[str, list[float]] = {"distrain BSP": [], "torchrun DDP": []}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            rates["distrain BSP"].append(run_distrain(args, Path(tmp) / f"d{r}"))
            rates["torchrun DDP"].append(run_torchrun(args, Path(tmp) / f"t{r}.json"))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    ray.shutdown()
    load.append(os.getloadavg()[0])
    ddp = statistics.median(rates["torchrun DDP"])
    print(f"\nCharLM {TASK_ARGS}, {args.workers} workers, global batch {args.global_batch}, {args.steps} steps, "
          f"Adam lr {LR}; load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after\n")  # fmt: skip
    print("| contender | samples/s (median) | min–max | vs torchrun DDP |\n|---|---:|---:|---:|")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"| {name} | {med:,.0f} | {min(values):,.0f}–{max(values):,.0f} | {med / ddp:.2f}× |")
    for name, lines in BREAKDOWN.items():
        print(f"\n{name}, per-step medians by round:\n" + "\n".join(f"- {line}" for line in lines))
    print("\nper round (distrain / DDP): " + ", ".join(
        f"{a / b:.2f}" for a, b in zip(rates["distrain BSP"], rates["torchrun DDP"], strict=True)))  # fmt: skip


if __name__ == "__main__":
    main()
