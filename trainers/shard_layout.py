"""The parameter server's order of θ across cut replicas (strategies/sharded_ps.py): one PS shard per worker
of a replica, PS shard p holding, for every parameter tensor in order, exactly the piece worker p of a
replica holds (its local part), concatenated.

Under `--fsdp D` PS shard d holds FSDP chunk d of every tensor (the dim-0 rows data-parallel rank d of a
replica holds, FSDP2's `Shard(0)`: torch.chunk's cut, ceil(rows / D) rows each, the last ones shorter or
empty). That is exactly worker d's local flat vector, so a worker pushes its gradient chunks and pulls
its θ chunks as they lie, and never holds the whole model.

Under `--tensor-parallel T` each tensor the plan splits is cut T ways along the dimension it splits (a
colwise Linear's rows, a rowwise one's columns: what TP rank t holds), and each tensor the plan leaves
whole is cut T ways along dim 0 (torch.chunk's cut: rank t pushes and pulls those rows of it).

Under both, `--fsdp D --tensor-parallel T`, worker (d, t) of a replica (its rank in the replica d x T + t,
the run's rank order) is PS shard d x T + t, and holds what FSDP2 makes of tensor parallelism's part: a
split tensor is cut T ways along its plan's dimension, then FSDP's chunk d of dim 0 of TP rank t's part
(FSDP2 chunks the local tensor of a DTensor: `_StridedShard(0)` where both cut dim 0); a tensor the plan
leaves whole is FSDP's chunk d of dim 0, which the T workers of data-parallel rank d hold alike, then cut
T ways along dim 0 of that chunk (rank t's rows). With D = 1 or T = 1 these are the layouts above.

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


def _chunk(index: np.ndarray, dim: int, parts: int, k: int) -> np.ndarray:
    """torch.chunk(index, parts, dim)[k] (empty past the last chunk)."""
    lo, hi = chunk_rows(index.shape[dim], parts, k)
    return np.take(index, np.arange(lo, hi), axis=dim)


class ShardLayout:
    """Where each piece of each parameter tensor lies in the whole flat θ and in the shards' order.

    `fsdp`: D, FSDP's chunks of dim 0. `tp`: T, and `dims` the dimension the tensor-parallel plan
    splits each tensor along (None: a tensor the T workers hold whole). The layout has D x T pieces,
    piece d x T + t being worker (d, t)'s (the module docstring): `self.shards`, one per PS shard."""

    def __init__(
        self, shapes: Sequence[Sequence[int]], fsdp: int, dims: Sequence[int | None] | None = None, tp: int = 1
    ) -> None:
        if fsdp < 1 or tp < 1:
            raise ValueError(f"fsdp and tp must be >= 1, got {fsdp} and {tp}")
        self.shapes = [tuple(int(n) for n in s) for s in shapes]
        self.fsdp, self.tp = fsdp, tp
        self.shards = fsdp * tp  # PS shards: one per worker of a replica
        self.dims = [None] * len(self.shapes) if dims is None else [None if k is None else int(k) for k in dims]
        if len(self.dims) != len(self.shapes):
            raise ValueError(f"{len(self.dims)} cut dimensions for {len(self.shapes)} tensors")
        # pieces[p]: the indices of the whole flat θ that shard p holds, per tensor in order (each piece
        # row-major within the worker's local part, as it flattens).
        self.pieces: list[list[np.ndarray]] = [[] for _ in range(self.shards)]
        offset = 0
        for shape, dim in zip(self.shapes, self.dims, strict=True):
            numel = math.prod(shape)
            whole = np.arange(offset, offset + numel, dtype=np.int64).reshape(shape if shape else (1,))
            if dim is not None and dim >= whole.ndim:
                raise ValueError(f"a tensor of shape {shape} has no dimension {dim} to cut")
            for d in range(fsdp):
                for t in range(tp):
                    if dim is None:  # FSDP's chunk d (a 0-d tensor: one row, on shard 0), then rank t's rows of it
                        piece = _chunk(_chunk(whole, 0, fsdp, d), 0, tp, t)
                    else:  # TP rank t's part, then FSDP's chunk d of it
                        piece = _chunk(_chunk(whole, dim, tp, t), 0, fsdp, d)
                    self.pieces[d * tp + t].append(piece.reshape(-1))
            offset += numel
        self.numel = offset
        self.sizes = [sum(len(p) for p in pieces) for pieces in self.pieces]
        starts = np.cumsum([0, *self.sizes])
        self.bounds = [(int(starts[p]), int(starts[p + 1])) for p in range(self.shards)]
        parts = [p for pieces in self.pieces for p in pieces]
        self.perm = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # π

    def chunk_sizes(self, p: int) -> list[int]:
        """The sizes of shard p's piece of each tensor, in order (worker p's local pieces' numel)."""
        return [len(piece) for piece in self.pieces[p]]

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
