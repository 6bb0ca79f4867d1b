"""The peer for benchmarks/fsdp_vs_torch.py: a plain torchrun + FSDP2 script doing the steps distrain does
(the char LM example's model and data, each rank its slice of the global batch, AdamW), printing the
tokens/s of the steps after the warm-up as one JSON line from rank 0. With `--checkpoint-steps K`, a bare
`torch.distributed.checkpoint.async_save` of the model and optimizer state (torch's own `get_state_dict`)
after every K-th step but the last, over a gloo group of its own, as the recipe goes; the JSON then has
each save's blocking seconds, the most over the ranks (waiting for the previous save, then the call itself).

    torchrun --nproc-per-node 4 benchmarks/_fsdp_plain.py --dim 128 --layers 2 --batch-size 16 --steps 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from char_lm import CharLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("dim", 128), ("layers", 2), ("batch-size", 16), ("steps", 40), ("seq-len", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--checkpoint-steps", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    task = CharLM(dim=args.dim, layers=args.layers, seq_len=args.seq_len)
    torch.manual_seed(0)
    model = task.build_model()
    mesh = init_device_mesh("cpu", (world,))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, _ = task.datasets()
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    global_batch = world * args.batch_size
    warmup = args.steps // 10
    save_group = dist.new_group(backend="gloo") if args.checkpoint_steps else None
    pending, blocked = None, []
    for step in range(args.steps):
        if step == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        ids = order[step * global_batch : (step + 1) * global_batch][rank * args.batch_size :][: args.batch_size]
        batch = train.get_batch(ids.numpy())
        loss = nn.functional.cross_entropy(model(batch[0]).reshape(-1, 256), batch[1].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.checkpoint_steps and (step + 1) % args.checkpoint_steps == 0 and step + 1 < args.steps:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            t1 = time.perf_counter()
            if pending is not None:
                pending.result()
            model_state, optim_state = get_state_dict(model, optimizer)
            where = f"{args.checkpoint_dir}/step-{step + 1}"
            pending = dcp.async_save(
                {"model": model_state, "optim": optim_state}, checkpoint_id=where, process_group=save_group
            )
            blocked.append(time.perf_counter() - t1)
    if pending is not None:
        pending.result()
    # A step is as slow as its slowest worker: per save, the most any rank was blocked (as distrain's figure).
    every = [None] * world
    dist.all_gather_object(every, blocked)
    blocked = [max(per_rank) for per_rank in zip(*every, strict=True)]
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        tokens = (args.steps - warmup) * global_batch * args.seq_len
        print(json.dumps({"tokens_per_s": tokens / seconds, "seconds": seconds, "save_block_s": blocked}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
