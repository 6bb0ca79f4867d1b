"""What a failure costs (issue 7), in one invocation.

Part 1, time lost per failure: the same BSP run (digits, cnn) uninterrupted and with one injected
failure (a worker killed; under the parameter-server transport also a shard killed), per transport.
Time lost = wall time of the failed run - wall time of the uninterrupted one, next to the run's own
accounting (summary.json `time_lost_s`: after a restart, seconds from the restored checkpoint's step
to the moment the rebuilt actors were ready; after a replacement in place (a worker under the PS),
seconds from the failure's detection to the replacement being set up). Runs are interleaved over
`--rounds` so drift on a shared machine hits all of them alike; the median is reported.

Part 2, checkpoint cost: seconds to write one checkpoint (atomic: temporary file, fsync, rename)
and its size, for the default model (cnn) and resnet18, with SGD momentum state.

    python benchmarks/fault_cost.py [--rounds 1] [--cases ps] [--no-checkpoint-cost] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import save_checkpoint
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training
from distrain.trainers.datasets import load_dataset
from distrain.trainers.local_trainer import LocalTrainer
from distrain.trainers.models import build_model
from distrain.trainers.task import ClassificationTask

BASE = dict(workers=2, epochs=3, segment_steps=5, checkpoint_steps=10, eval_every=0)
CASES = {  # name -> extra config
    "collective, none": dict(),
    "collective, worker killed": dict(chaos=["kill-worker@33:1"]),
    "ps, none": dict(transport="ps", ps_shards=2),
    "ps, worker killed (replaced)": dict(transport="ps", ps_shards=2, chaos=["kill-worker@33:1"]),
    "ps, shard killed": dict(transport="ps", ps_shards=2, chaos=["kill-ps@33:1"]),
}


def time_lost(rounds: int, tmp: Path, prefix: str = "") -> list[str]:
    cases = {k: v for k, v in CASES.items() if k.startswith(prefix)}
    walls: dict[str, list[float]] = {k: [] for k in cases}
    accounted: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(rounds):
        for name, extra in cases.items():
            run = run_training(RunConfig(run_dir=str(tmp / f"{r}-{name}".replace(" ", "_")), **(BASE | extra)))
            walls[name].append(run.summary["wall_time_s"])
            accounted[name].append(run.summary["time_lost_s"])
            print(f"{name}: wall {run.summary['wall_time_s']:.1f} s, failures {run.summary['failures']}", flush=True)
    lines = [
        "| transport, failure | wall time (s) | time lost vs uninterrupted (s) | time_lost_s in summary.json |",
        "|---|---:|---:|---:|",
    ]
    for name in cases:
        wall = statistics.median(walls[name])
        baseline = statistics.median(walls[name.split(",")[0] + ", none"])
        lost = "-" if name.endswith("none") else f"{wall - baseline:.1f}"
        lines.append(f"| {name} | {wall:.1f} | {lost} | {statistics.median(accounted[name]):.1f} |")
    return lines


def checkpoint_cost(tmp: Path, reps: int = 3) -> list[str]:
    data = load_dataset("digits", "")
    lines = ["| model | parameters | checkpoint bytes | seconds per checkpoint (median of 3) |", "|---|---:|---:|---:|"]
    for model_name in ("cnn", "resnet18"):
        model = build_model(model_name, data.info, 0)
        trainer = LocalTrainer(model, ClassificationTask(), "sgd", 0.05, 0.9, 0.0, "cpu")
        x, y = data.train_batch(list(range(32)))
        trainer.compute_gradients((x, y))
        trainer.apply_update(0.05)  # momentum buffers exist, as in a real checkpoint
        config = RunConfig(model=model_name).to_dict()
        seconds = []
        for i in range(reps):
            t0 = time.perf_counter()
            path = save_checkpoint(tmp / model_name, f"c{i}.pt", trainer.state_dict(), config=config, epoch=1,
                                   global_step=10)  # fmt: skip
            seconds.append(time.perf_counter() - t0)
        size = path.stat().st_size
        lines.append(f"| {model_name} | {trainer.numel:,} | {size:,} | {statistics.median(seconds):.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cases", default="", help="only the cases whose name starts with this (e.g. ps)")
    parser.add_argument("--no-checkpoint-cost", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ckpt = [] if args.no_checkpoint_cost else checkpoint_cost(tmp)
        print("\n".join(ckpt), flush=True)
        start_local_ray(num_cpus=8)
        lost = time_lost(args.rounds, tmp, args.cases)
    text = "\n".join(["### Time lost per failure (BSP, digits, cnn, 2 workers)", *lost, "",
                      "### Checkpoint cost", *ckpt])  # fmt: skip
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
