"""Split the flat parameter vector into K contiguous, byte-balanced slices (one per PS shard)."""

from __future__ import annotations

from typing import Any


def partition(num_params: int, num_shards: int) -> list[tuple[int, int]]:
    """K contiguous [start, stop) slices covering [0, num_params) once; sizes differ by at most one
    element, so with one dtype the shards carry equal bytes to within one value."""
    if not 1 <= num_shards <= num_params:
        raise ValueError(f"cannot split {num_params} parameters into {num_shards} shards")
    bounds = [num_params * k // num_shards for k in range(num_shards + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def ps_clients(config: Any) -> int:
    """The clients each PS shard counts: every worker actor, or under --fsdp D one per replica (its rank-d
    worker talks to shard d, strategies/sharded_ps.py)."""
    return config.num_worker_actors // config.replica_size if config.sharded else config.num_worker_actors
