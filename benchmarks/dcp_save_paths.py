"""distrain's sharded save path against a bare `dcp.async_save` of the same state, alternately in the same
processes (no Ray): the char LM example's transformer (dim 128, 2 layers) under FSDP2 over the ranks,
AdamW, 24 steps, a save after every second step, bare and distrain's in turn. Prints the median blocking
seconds of each (per save, the most any rank was blocked: waiting for the previous save, making the state
dict, staging) and every save's, then the same for the CPU seconds the blocked thread itself spent
(`time.thread_time`: the work, without the waits for a core that a loaded machine adds).

    torchrun --nproc-per-node 4 benchmarks/dcp_save_paths.py [--dir /tmp/dcp-save-paths]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distrain.trainers.sharded_checkpoint import AsyncSaver, optimizer_entries

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from char_lm import CharLM  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dir", default="/tmp/dcp-save-paths")
args = parser.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
task = CharLM(dim=128, layers=2, seq_len=64)
torch.manual_seed(0)
model = task.build_model()
mesh = init_device_mesh("cpu", (world,))
for c in model.children():
    if any(True for _ in c.parameters()):
        fully_shard(c, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
train, _ = task.datasets()
names = [n for n, p in model.named_parameters()]
params = list(model.parameters())
saver = AsyncSaver()
group = saver.group
times: dict[str, list[float]] = {"bare": [], "distrain": []}
cpu: dict[str, list[float]] = {"bare": [], "distrain": []}
pending = None
for i in range(24):
    b = train.get_batch(torch.arange(i * 16, i * 16 + 16).numpy())
    nn.functional.cross_entropy(model(b[0]).reshape(-1, 256), b[1].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()
    if i % 2 == 1:
        kind = "bare" if (i // 2) % 2 == 0 else "distrain"
        t0, c0 = time.perf_counter(), time.thread_time()
        if kind == "bare":
            saver.wait()
            if pending is not None:
                pending.result()
            m, o = get_state_dict(model, opt)
            pending = dcp.async_save(
                {"model": m, "optim": o}, checkpoint_id=f"{args.dir}/bare-{i}", process_group=group
            )
        else:
            if pending is not None:
                pending.result()
                pending = None
            entries = {f"model/{k}": v for k, v in model.state_dict().items()} | optimizer_entries(opt, params, names)
            saver.save(entries, Path(f"{args.dir}/distrain-{i}"))
        el = [None] * world
        dist.all_gather_object(el, (time.perf_counter() - t0, time.thread_time() - c0))
        times[kind].append(max(e[0] for e in el))
        cpu[kind].append(max(e[1] for e in el))
saver.close()
if pending is not None:
    pending.result()
if rank == 0:
    for what, got in (("blocked ms", times), ("CPU ms of the blocked thread", cpu)):
        print(
            what,
            {k: round(statistics.median(v) * 1e3, 1) for k, v in got.items()},
            {k: [round(x * 1e3) for x in v] for k, v in got.items()},
        )
