"""The PS order of θ across cut replicas (trainers/shard_layout.py): under --fsdp D PS shard d holds FSDP
chunk d of every tensor, under --tensor-parallel T shard t TP rank t's part, under both shard d x T + t
worker (d, t)'s piece; π and its inverse round-trip, uneven and empty chunks included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distrain.trainers.shard_layout import ShardLayout, chunk_rows


def test_chunk_rows_follow_torch_chunk():
    # FSDP2's Shard(0) cuts as torch.chunk does, padding the missing chunks with empty ones
    for rows in range(0, 9):
        for shards in range(1, 6):
            pieces = torch.arange(rows).chunk(shards) if rows else ()
            got = [chunk_rows(rows, shards, d) for d in range(shards)]
            expected = [(int(p[0]), int(p[-1]) + 1) for p in pieces]
            assert got[: len(expected)] == expected
            assert all(lo == hi for lo, hi in got[len(expected) :])  # the empty tail
            assert sum(hi - lo for lo, hi in got) == rows


def test_two_shards_by_hand():
    # a (3, 2) matrix (rows 0-1 on shard 0, row 2 on shard 1) and a (3,) vector (0-1 | 2)
    layout = ShardLayout([(3, 2), (3,)], 2)
    whole = np.arange(9, dtype=np.float32)  # matrix 0..5, vector 6..8
    assert layout.to_shards(whole).tolist() == [0, 1, 2, 3, 6, 7, 4, 5, 8]
    assert layout.bounds == [(0, 6), (6, 9)]
    assert layout.chunk_sizes(0) == [4, 2] and layout.chunk_sizes(1) == [2, 1]


@pytest.mark.parametrize(
    "shapes, shards",
    [
        ([(256, 64), (256,), (10, 256), (10,)], 2),  # the mlp's shapes
        ([(5, 3), (7,), (2, 2, 2)], 3),  # uneven chunks
        ([(3, 4), (1,), (2,)], 4),  # D larger than a dim: empty chunks
        ([(1, 5)], 8),
        ([(4, 4)], 1),  # D = 1: the identity
    ],
)
def test_round_trip(shapes, shards):
    layout = ShardLayout(shapes, shards)
    n = layout.numel
    whole = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    permuted = layout.to_shards(whole)
    assert sorted(layout.perm.tolist()) == list(range(n))  # a permutation
    np.testing.assert_array_equal(layout.from_shards(permuted), whole)
    t = torch.from_numpy(whole)
    assert torch.equal(layout.from_shards(layout.to_shards(t)), t)  # torch tensors too
    assert layout.bounds[-1][1] == n and [b - a for a, b in layout.bounds] == layout.sizes
    if shards == 1:
        np.testing.assert_array_equal(permuted, whole)


@pytest.mark.parametrize("shapes, shards", [([(5, 3), (7,), (2, 2, 2)], 3), ([(3, 4), (1,), (2,)], 4)])
def test_shard_d_is_the_workers_local_flat_vector(shapes, shards):
    """Shard d's slice = concat over tensors of torch.chunk(tensor, D)[d] (empty past the last chunk)."""
    layout = ShardLayout(shapes, shards)
    whole = torch.arange(layout.numel, dtype=torch.float32)
    tensors, offset = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        tensors.append(whole[offset : offset + n].view(shape))
        offset += n
    permuted = layout.to_shards(whole)
    for d, (lo, hi) in enumerate(layout.bounds):
        local = []
        for t in tensors:
            chunks = t.chunk(shards)
            local.append(chunks[d].reshape(-1) if d < len(chunks) else t.new_empty(0))
        assert torch.equal(permuted[lo:hi], torch.cat(local))


def test_wrong_length_refused():
    with pytest.raises(ValueError, match="flat vector of 6"):
        ShardLayout([(3, 2)], 2).to_shards(np.zeros(5))


def test_ps_shards_default_to_d_under_fsdp():
    from distrain.config import RunConfig

    config = RunConfig(model="mlp", strategy="ssp", transport="ps", workers=2, fsdp=3)
    assert config.ps_shards == 3 and config.num_worker_actors == 6
    assert RunConfig(model="mlp", strategy="async", transport="ps", workers=2).ps_shards == 1


def test_a_tensor_parallel_layout_cuts_each_tensor_along_its_plans_dimension():
    """--tensor-parallel T over the PS: shard t holds TP rank t's part of every split tensor (a colwise
    weight's rows, a rowwise weight's columns: torch.chunk along that dimension, row-major) and chunk t of
    dim 0 of every tensor held whole (the rowwise bias, a layer not in the plan); the mlp's plan says which."""
    import torch
    from torch import nn

    from distrain.trainers.tensor_parallel import BUILTIN_PLANS, cut_dims

    mlp = nn.Sequential(nn.Flatten(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    dims = cut_dims(mlp, BUILTIN_PLANS["mlp"])
    assert dims == [0, 0, 1, None, None, None]
    shapes = [tuple(p.shape) for p in mlp.parameters()]
    layout = ShardLayout(shapes, 1, dims, tp=2)
    tensors = [torch.arange(float(p.numel())).view(p.shape) + 100 * i for i, p in enumerate(mlp.parameters())]
    whole = torch.cat([t.reshape(-1) for t in tensors])
    shards = layout.to_shards(whole)
    for t in range(2):
        lo, hi = layout.bounds[t]
        expected = [x.chunk(2, dim=0 if d is None else d)[t].reshape(-1) for x, d in zip(tensors, dims, strict=True)]
        assert torch.equal(shards[lo:hi], torch.cat(expected))
        assert layout.chunk_sizes(t) == [len(e) for e in expected]
    assert torch.equal(layout.from_shards(shards), whole)
    # The last layer's bias (3 rows) splits 2 + 1; a 0-d tensor lies on shard 0.
    assert ShardLayout([(3,), ()], 2).chunk_sizes(1) == [1, 0]


def _torch_chunk(x, parts, dim, k):
    chunks = x.chunk(parts, dim=dim) if x.shape[dim] else ()
    return chunks[k] if k < len(chunks) else x.narrow(dim, 0, 0)


@pytest.mark.parametrize("shards, tp", [(2, 2), (3, 2), (2, 3)])
def test_under_fsdp_and_tensor_parallel_shard_d_t_is_worker_d_ts_piece(shards, tp):
    """--fsdp D --tensor-parallel T over the PS: shard d x T + t holds what worker (d, t) of a replica holds,
    FSDP2's chunk d (dim 0, torch.chunk's cut) of TP rank t's part of a split tensor (a colwise weight's rows,
    a rowwise weight's columns), and rows t of FSDP's chunk d of a tensor the plan leaves whole (a rowwise
    bias, a layer not in the plan: FSDP's chunk, then the T workers' rows of it), uneven and empty pieces
    included; every value lies in exactly one shard, and D = 1 or T = 1 give the one-level layouts."""
    from torch import nn

    from distrain.trainers.tensor_parallel import BUILTIN_PLANS, cut_dims

    mlp = nn.Sequential(nn.Flatten(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    dims = cut_dims(mlp, BUILTIN_PLANS["mlp"])  # [0, 0, 1, None, None, None]
    shapes = [tuple(p.shape) for p in mlp.parameters()]
    layout = ShardLayout(shapes, shards, dims, tp)
    assert layout.shards == shards * tp and len(layout.bounds) == shards * tp
    tensors = [torch.arange(float(p.numel())).view(p.shape) + 100 * i for i, p in enumerate(mlp.parameters())]
    whole = torch.cat([t.reshape(-1) for t in tensors])
    permuted = layout.to_shards(whole)
    assert sorted(layout.perm.tolist()) == list(range(layout.numel))  # each value in exactly one shard
    for d in range(shards):
        for t in range(tp):
            expected = [
                _torch_chunk(_torch_chunk(x, shards, 0, d), tp, 0, t)
                if k is None
                else _torch_chunk(_torch_chunk(x, tp, k, t), shards, 0, d)
                for x, k in zip(tensors, dims, strict=True)
            ]
            lo, hi = layout.bounds[d * tp + t]
            assert torch.equal(permuted[lo:hi], torch.cat([e.reshape(-1) for e in expected])), (d, t)
            assert layout.chunk_sizes(d * tp + t) == [e.numel() for e in expected]
    assert torch.equal(layout.from_shards(permuted), whole)
    # One level each: T = 1 is FSDP's layout, D = 1 the tensor-parallel one.
    assert ShardLayout(shapes, shards, dims, 1).perm.tolist() == ShardLayout(shapes, shards).perm.tolist()


def test_two_by_two_by_hand():
    """D = 2 x T = 2: a (4, 2) matrix split along its rows (TP rank t: rows 2t, 2t + 1; FSDP chunk d of those:
    row 2t + d) and a (4,) vector held whole (FSDP chunk d: 2d, 2d + 1; rank t's row of it: 2d + t)."""
    layout = ShardLayout([(4, 2), (4,)], 2, [0, None], tp=2)
    whole = np.arange(12, dtype=np.float32)  # matrix rows [0, 1] [2, 3] [4, 5] [6, 7], vector 8..11
    # shard 0 = (d 0, t 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    assert layout.to_shards(whole).tolist() == [0, 1, 8, 4, 5, 9, 2, 3, 10, 6, 7, 11]
    assert layout.bounds == [(0, 3), (3, 6), (6, 9), (9, 12)]
