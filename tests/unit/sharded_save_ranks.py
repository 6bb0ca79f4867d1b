"""Two ranks (gloo, FSDP2 over both) saving through AsyncSaver twice, for test_checkpoint_staging.py:
each save is what the state was when `save` returned (training changes it at once afterwards), and the
second save copies into the first's staging buffers. Rank 0 writes what it found to <dir>/result.json.

    python tests/unit/sharded_save_ranks.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from distrain.trainers.sharded_checkpoint import MODEL, AsyncSaver, optimizer_entries, read_whole


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _rank(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store", 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))  # 7 rows: cut unevenly over 2 ranks
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=0.1)
    saver = AsyncSaver()
    expected, buffers = [], []
    for save in range(2):
        model(torch.randn(4, 5)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(_full(model))
        entries = {f"{MODEL}/{k}": v for k, v in model.state_dict().items()}
        saver.save(entries | optimizer_entries(optimizer, params, names), Path(root) / f"s{save}")
        buffers.append({k: s.buffer.data_ptr() for k, s in saver.staging._staged.items()})
        with torch.no_grad():  # training goes on at once: the save in flight must not see it
            for p in params:
                p.to_local().add_(100.0)
    saver.close()
    dist.barrier()
    if rank == 0:
        keys, result = list(model.state_dict()), {}
        for save in range(2):
            whole = read_whole(Path(root) / f"s{save}", keys, names)
            result[f"s{save}_equal"] = all(torch.equal(whole["model"][k], expected[save][k]) for k in keys)
            result[f"s{save}_step"] = whole["optimizer"]["scalars"]["step"]
        result["buffers_reused"] = buffers[0] == buffers[1]
        result["entries"] = len(buffers[0])
        (Path(root) / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(sys.argv[1],), nprocs=2)
