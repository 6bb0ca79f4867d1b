"""Paired probe: where a BSP step's time goes, DDP vs distrain's flat all-reduce, on one process group.

    torchrun --standalone --nproc_per_node 2 benchmarks/ddp_vs_flat_probe.py [--model resnet18] [--steps 60]

Three replicas of the same model train side by side in the same two processes, in alternating blocks
of `--block` steps, so that load from anything else on the machine hits all three alike (a shared
machine makes separate runs too noisy to compare step times that differ by 10-20%):

  ddp      torch DistributedDataParallel (gloo, default buckets): the all-reduce of each bucket is
           launched from autograd hooks while the rest of backward still runs
  flat     distrain's BSP step: `LocalTrainer.compute_gradients` (gradients land in one flat buffer),
           then one blocking all-reduce of the whole buffer after backward, a division, the SGD step
  overlap  a sketch of the fix proposed for distrain: the same flat buffer cut into DDP-sized
           contiguous buckets (last parameters first); a post-accumulate-grad hook launches an async
           all-reduce of a bucket as soon as all its gradients are in; the step waits for all of them

Rank 0 prints the median step time of each (slowest rank per step) and, for `flat`, how the step
splits into compute and all-reduce. All three see the same batches (distrain's EpochSharder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrain.trainers.datasets import load_dataset
from distrain.trainers.local_trainer import LocalTrainer
from distrain.trainers.models import build_model
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.task import ClassificationTask

FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's defaults (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
BUCKET_BYTES = 25 * 1024 * 1024


class OverlappedAllReduce:
    """Bucketed, hook-driven async all-reduce of a LocalTrainer's flat gradient buffer."""

    def __init__(self, trainer: LocalTrainer, world: int) -> None:
        self.trainer = trainer
        self.world = world
        self.works: list[Any] = []
        offsets, offset = [], 0
        for p in trainer.params:
            offsets.append((offset, offset + p.numel()))
            offset += p.numel()
        # Gradients arrive roughly in reverse order of the parameters: bucket from the end.
        self.buckets: list[tuple[int, int]] = []
        self.bucket_of: dict[int, int] = {}
        size = trainer.grads_flat.element_size()
        cap, hi, lo, members = FIRST_BUCKET_BYTES, offsets[-1][1], offsets[-1][1], []
        for i in range(len(trainer.params) - 1, -1, -1):
            lo = offsets[i][0]
            members.append(i)
            if (hi - lo) * size >= cap or i == 0:
                for m in members:
                    self.bucket_of[m] = len(self.buckets)
                self.buckets.append((lo, hi))
                hi, members, cap = lo, [], BUCKET_BYTES
        self.needed = [0] * len(self.buckets)
        for b in self.bucket_of.values():
            self.needed[b] += 1
        self.ready = [0] * len(self.buckets)
        for i, p in enumerate(trainer.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))

    def _on_grad(self, i: int) -> None:
        b = self.bucket_of[i]
        self.ready[b] += 1
        if self.ready[b] == self.needed[b]:
            lo, hi = self.buckets[b]
            self.works.append(dist.all_reduce(self.trainer.grads_flat[lo:hi], async_op=True))

    def finish(self) -> None:
        for w in self.works:
            w.wait()
        self.works.clear()
        self.ready = [0] * len(self.buckets)
        self.trainer.grads_flat.div_(self.world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=60, help="steps per replica")
    p.add_argument("--block", type=int, default=5, help="steps of one replica before switching")
    p.add_argument("--warmup", type=int, default=5, help="steps per replica left out of the medians")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--json", default="", help="rank 0 writes the medians here")
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_dataset(a.dataset)
    sharder = EpochSharder(data.train_size, a.global_batch, 0)
    spe = sharder.steps_per_epoch

    ddp = DistributedDataParallel(build_model(a.model, data.info, 0))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=a.momentum)
    loss_fn = nn.CrossEntropyLoss()
    flat = LocalTrainer(build_model(a.model, data.info, 0), ClassificationTask(), "sgd", a.lr, a.momentum, 0.0)
    over = LocalTrainer(build_model(a.model, data.info, 0), ClassificationTask(), "sgd", a.lr, a.momentum, 0.0)
    hooks = OverlappedAllReduce(over, world)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, step = divmod(i, spe)
        return data.train_batch(sharder.worker_indices(epoch, step, rank, world))

    def step_ddp(i: int) -> dict[str, float]:
        x, y = batch(i)
        ddp_opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        ddp_opt.step()
        return {}

    def step_flat(i: int) -> dict[str, float]:
        x, y = batch(i)
        t0 = time.perf_counter()
        flat.compute_gradients((x, y))
        t1 = time.perf_counter()
        dist.all_reduce(flat.grads_flat)
        flat.grads_flat.div_(world)
        t2 = time.perf_counter()
        flat.apply_update(a.lr)
        return {"fwd_bwd": t1 - t0, "allreduce": t2 - t1, "opt": time.perf_counter() - t2}

    def step_over(i: int) -> dict[str, float]:
        x, y = batch(i)
        over.compute_gradients((x, y))
        hooks.finish()
        over.apply_update(a.lr)
        return {}

    modes = {"ddp": step_ddp, "flat": step_flat, "overlap": step_over}
    times: dict[str, list[float]] = {m: [] for m in modes}
    parts: dict[str, list[float]] = {"fwd_bwd": [], "allreduce": [], "opt": []}
    done = dict.fromkeys(modes, 0)
    while min(done.values()) < a.steps:
        for name, fn in modes.items():
            for _ in range(min(a.block, a.steps - done[name])):
                dist.barrier()
                t0 = time.perf_counter()
                extra = fn(done[name])
                elapsed = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step of the slowest rank
                if done[name] >= a.warmup:
                    times[name].append(float(elapsed))
                    for k, v in extra.items():
                        parts[k].append(v)
                done[name] += 1
    if rank == 0:
        result = {m: 1e3 * statistics.median(t) for m, t in times.items()}
        result |= {f"flat_{k}": 1e3 * statistics.median(v) for k, v in parts.items()}
        result |= {"buckets_overlap": len(hooks.buckets), "params": flat.numel, "model": a.model}
        print(
            f"{a.model}: {flat.numel:,} parameters ({flat.nbytes / 2**20:.1f} MiB of gradient), "
            f"{len(hooks.buckets)} buckets in the overlap sketch; median step (slowest rank), ms:"
        )
        for m in modes:
            print(f"  {m:8s} {result[m]:9.2f}   ({result[m] / result['ddp']:.2f}x ddp)")
        print(
            f"  flat, on rank 0: fwd+bwd {result['flat_fwd_bwd']:.2f}, all-reduce {result['flat_allreduce']:.2f}, "
            f"optimizer {result['flat_opt']:.2f} (medians of each part; they need not add up to the step's)"
        )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()  # leave together (see _ddp_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
