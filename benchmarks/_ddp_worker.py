"""The training loop of the non-distrain contenders of `bsp_throughput.py`, and its command line.

One loop, three launchers, so the contenders differ only in how gradients are combined:

    python benchmarks/_ddp_worker.py --out F ...                          single process (no wrapper)
    torchrun --nproc_per_node 2 benchmarks/_ddp_worker.py --out F ...     DDP over gloo
    torchrun --nproc_per_node 2 benchmarks/_ddp_worker.py --mode flat ... distrain's step without Ray
    ray.train.torch.TorchTrainer -> train_loop(..., wrap=prepare_model)    Ray Train (DDP over gloo)

The work per step is the work a distrain BSP worker does per step: build the batch from this rank's
slice of `EpochSharder`'s order (epochs wrap around), forward, backward, combine gradients, SGD step.
Each rank writes `<out>.rank<r>.json` with the wall-clock end time (`time.time()`, comparable across
processes on one machine) of every step and a per-step breakdown.

`--mode flat` runs distrain's own step (`LocalTrainer` with flat parameter/gradient buffers, then one
all-reduce of the whole flat gradient after backward and a division by the world size, as
`strategies/bsp.py` does) under torchrun. It is a diagnostic: the gap between it and distrain on Ray
is the orchestration; the gap between it and DDP is the gradient exchange.

Kept light on purpose (torch and distrain's trainers, no Ray, no pandas): it is on the time-to-first-step
path of the torchrun and single-process contenders.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def train_loop(
    *,
    model: str,
    dataset: str,
    global_batch: int,
    steps: int,
    seed: int,
    lr: float,
    momentum: float,
    threads: int,
    rank: int,
    world: int,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    flat: bool = False,
) -> dict[str, Any]:
    """Train `steps` global steps; returns this rank's timings (see the module docstring)."""
    torch.set_num_threads(threads)
    from distrain.trainers.datasets import load_dataset
    from distrain.trainers.models import build_model
    from distrain.trainers.sharding import EpochSharder

    data = load_dataset(dataset)
    net = build_model(model, data.info, seed)
    sharder = EpochSharder(data.train_size, global_batch, seed)
    spe = sharder.steps_per_epoch
    if flat:
        return _flat_loop(net, data, sharder, steps, lr, momentum, rank, world, threads)
    if wrap is not None:
        net = wrap(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    ends, losses, data_s, fwd_bwd_s, opt_s = [], [], [], [], []
    for i in range(steps):
        epoch, step = divmod(i, spe)
        t0 = time.perf_counter()
        x, y = data.train_batch(sharder.worker_indices(epoch, step, rank, world))
        t1 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        loss.backward()  # under DDP this also waits for the bucketed all-reduce
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        ends.append(time.time())
        losses.append(float(loss.detach()))
        data_s.append(t1 - t0)
        fwd_bwd_s.append(t2 - t1)
        opt_s.append(t3 - t2)
    return {
        "rank": rank,
        "world": world,
        "threads": torch.get_num_threads(),
        "samples_per_step": global_batch // world,
        "step_end": ends,
        "loss": losses,
        "data_s": data_s,
        "fwd_bwd_s": fwd_bwd_s,
        "opt_s": opt_s,
    }


def _flat_loop(
    net: nn.Module,
    data: Any,
    sharder: Any,
    steps: int,
    lr: float,
    momentum: float,
    rank: int,
    world: int,
    threads: int,
) -> dict[str, Any]:
    """distrain's BSP step (trainers/local_trainer.py + strategies/bsp.py), on a torchrun process group."""
    import torch.distributed as dist

    from distrain.trainers.local_trainer import LocalTrainer
    from distrain.trainers.task import ClassificationTask

    trainer = LocalTrainer(net, ClassificationTask(), "sgd", lr, momentum, 0.0)
    if world > 1:
        dist.broadcast(trainer.params_flat, src=0)
    spe = sharder.steps_per_epoch
    ends, losses, data_s, fwd_bwd_s, comm_s, opt_s = [], [], [], [], [], []
    for i in range(steps):
        epoch, step = divmod(i, spe)
        t0 = time.perf_counter()
        x, y = data.train_batch(sharder.worker_indices(epoch, step, rank, world))
        t1 = time.perf_counter()
        loss = trainer.compute_gradients((x, y))
        t2 = time.perf_counter()
        if world > 1:
            dist.all_reduce(trainer.grads_flat, op=dist.ReduceOp.SUM)
            trainer.grads_flat.div_(world)
        t3 = time.perf_counter()
        trainer.apply_update(lr)
        t4 = time.perf_counter()
        ends.append(time.time())
        losses.append(loss)
        data_s.append(t1 - t0)
        fwd_bwd_s.append(t2 - t1)
        comm_s.append(t3 - t2)
        opt_s.append(t4 - t3)
    return {
        "rank": rank,
        "world": world,
        "threads": torch.get_num_threads(),
        "samples_per_step": sharder.global_batch // world,
        "step_end": ends,
        "loss": losses,
        "data_s": data_s,
        "fwd_bwd_s": fwd_bwd_s,
        "comm_s": comm_s,
        "opt_s": opt_s,
    }


def write_result(out: str, result: dict[str, Any]) -> None:
    path = f"{out}.rank{result['rank']}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result prefix: each rank writes <out>.rank<r>.json")
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of this process")
    p.add_argument(
        "--mode",
        choices=("ddp", "flat"),
        default="ddp",
        help="ddp: DistributedDataParallel "
        "(plain loop when not under torchrun); flat: distrain's LocalTrainer + one all-reduce",
    )
    a = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    wrap = None
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        wrap = DistributedDataParallel
    try:
        result = train_loop(
            model=a.model,
            dataset=a.dataset,
            global_batch=a.global_batch,
            steps=a.steps,
            seed=a.seed,
            lr=a.lr,
            momentum=a.momentum,
            threads=a.threads,
            rank=rank,
            world=world,
            wrap=wrap,
            flat=a.mode == "flat",
        )
        write_result(a.out, result)
        if world > 1:
            # Leave together: a rank that tears down gloo while its peer is still finishing the last
            # all-reduce can make the peer abort ("terminate called without an active exception").
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
