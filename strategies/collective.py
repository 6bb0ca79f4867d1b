"""Collective transport: a torch.distributed process group across the worker actors.

gloo on CPU, NCCL when the workers hold GPUs. Rank 0 publishes "host:port" (see `free_address`) and
every rank joins through a TCP rendezvous. Each worker actor is its own process, so the default
process group is the group.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def free_address(host: str) -> str:
    """A "host:port" on this node that was free a moment ago, for rank 0 to host the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of `nbytes`: 2(P-1)/P * n."""
    return 2 * (world_size - 1) * nbytes // world_size


class CollectiveGroup:
    def __init__(self, rank: int, world_size: int, rendezvous: str, backend: str, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{rendezvous}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def all_reduce_mean_(self, tensor: torch.Tensor) -> float:
        """Average `tensor` across workers in place; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(self.world_size)
        return time.perf_counter() - t0

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.world_size > 1:
            dist.broadcast(tensor, src=src)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
