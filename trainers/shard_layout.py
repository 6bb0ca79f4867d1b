"""The parameter server's order of θ under `--fsdp D` (strategies/sharded_ps.py): PS shard d holds, for
every parameter tensor in order, FSDP chunk d of it (the dim-0 rows data-parallel rank d of a replica
holds, FSDP2's `Shard(0)`: torch.chunk's cut, ceil(rows / D) rows each, the last ones shorter or
empty), concatenated. That is exactly worker d's local flat vector, so a worker pushes its gradient
chunks and pulls its θ chunks as they lie, and never holds the whole model.

Under `--tensor-parallel T` (no --fsdp) the same layout with one cut dimension per tensor: PS shard t
holds TP rank t's part of every tensor the plan splits (along the dimension it splits: a colwise
Linear's rows, a rowwise one's columns) and chunk t of dim 0 of every tensor the plan leaves whole.

The shards' flat vector is a permutation π of the whole flat θ (tensors in order, each row-major):
shards = whole[π], whole[π] = shards. Checkpoints and the final model un-permute it, so they stay whole
and load at any layout. Pure arithmetic over shapes: numpy only, no torch, no config.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def chunk_rows(rows: int, shards: int, d: int) -> tuple[int, int]:
    """Rows [lo, hi) of a tensor with `rows` rows in dim 0 that FSDP shard `d` of `shards` holds."""
    size = -(-rows // shards)  # ceil
    return min(d * size, rows), min((d + 1) * size, rows)


class ShardLayout:
    """Where each chunk of each parameter tensor lies in the whole flat θ and in the shards' order.

    `dims`: the dimension each tensor is cut along (None: dim 0 for all, FSDP's). Under
    `--tensor-parallel T` (strategies/sharded_ps.py) a split tensor is cut along the dimension its plan
    splits (a colwise Linear's rows, a rowwise one's columns: what TP rank t holds) and a tensor the plan
    leaves whole along dim 0, torch.chunk's cut as for FSDP."""

    def __init__(self, shapes: Sequence[Sequence[int]], shards: int, dims: Sequence[int] | None = None) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.shapes = [tuple(int(n) for n in s) for s in shapes]
        self.shards = shards
        self.dims = [0] * len(self.shapes) if dims is None else [int(k) for k in dims]
        if len(self.dims) != len(self.shapes):
            raise ValueError(f"{len(self.dims)} cut dimensions for {len(self.shapes)} tensors")
        # pieces[d]: the indices of the whole flat θ that shard d holds, per tensor in order (each piece
        # row-major within the chunk, as the worker's local tensor flattens).
        self.pieces: list[list[np.ndarray]] = [[] for _ in range(shards)]
        offset = 0
        for shape, dim in zip(self.shapes, self.dims, strict=True):
            numel = math.prod(shape)
            whole = np.arange(offset, offset + numel, dtype=np.int64).reshape(shape if shape else (1,))
            if dim >= whole.ndim:
                raise ValueError(f"a tensor of shape {shape} has no dimension {dim} to cut")
            size = whole.shape[dim]  # a 0-d tensor: one row, on shard 0
            for d in range(shards):
                lo, hi = chunk_rows(size, shards, d)
                self.pieces[d].append(np.take(whole, np.arange(lo, hi), axis=dim).reshape(-1))
            offset += numel
        self.numel = offset
        self.sizes = [sum(len(p) for p in pieces) for pieces in self.pieces]
        starts = np.cumsum([0, *self.sizes])
        self.bounds = [(int(starts[d]), int(starts[d + 1])) for d in range(shards)]
        parts = [p for pieces in self.pieces for p in pieces]
        self.perm = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # π

    def chunk_sizes(self, d: int) -> list[int]:
        """The sizes of shard d's chunk of each tensor, in order (its local parts' numel)."""
        return [len(p) for p in self.pieces[d]]

    def to_shards(self, whole: Any) -> Any:
        """The whole flat θ (numpy array or torch tensor) in the shards' order: concat_d concat_t chunk_d(t)."""
        self._check(whole)
        return whole[self._index(whole)]

    def from_shards(self, permuted: Any) -> Any:
        """The inverse: the shards' concatenated vectors back in the whole model's order."""
        self._check(permuted)
        out = permuted.new_empty(permuted.shape) if hasattr(permuted, "new_empty") else np.empty_like(permuted)
        out[self._index(permuted)] = permuted
        return out

    def _index(self, like: Any) -> Any:
        if isinstance(like, np.ndarray):
            return self.perm
        import torch

        return torch.from_numpy(self.perm).to(like.device)

    def _check(self, flat: Any) -> None:
        if len(flat.shape) != 1 or flat.shape[0] != self.numel:
            raise ValueError(f"expected a flat vector of {self.numel} values, got shape {tuple(flat.shape)}")
