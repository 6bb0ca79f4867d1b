"""Sandblaster's checkpointed L-BFGS state across layouts (strategies/sandblaster.py `join_states`,
`split_state`): a cut run's shards hold θ and the history permuted (FSDP's chunks, trainers/shard_layout.py);
joined and un-permuted they are the whole state in the model's order, which cuts again at any plain
--ps-shards or any cut layout, exactly."""

from __future__ import annotations

import numpy as np

from distrain.strategies.sandblaster_common import join_states, split_state
from distrain.trainers.shard_layout import ShardLayout

SHAPES = [(10, 64), (10,)]  # the linear model on digits: FSDP cuts both in two


def whole_state(rng: np.random.Generator, n: int) -> dict:
    v = lambda: rng.standard_normal(n)  # noqa: E731
    return {"theta": v(), "s": [v(), v()], "y": [v(), v()], "prev_grad": v(), "step": None}


def same(a: dict, b: dict) -> bool:
    flat = lambda s: [s["theta"], *s["s"], *s["y"], s["prev_grad"]]  # noqa: E731
    return a["step"] is b["step"] is None and all(np.array_equal(x, y) for x, y in zip(flat(a), flat(b), strict=True))


def test_a_cut_runs_state_joins_whole_and_cuts_again_at_any_layout():
    layout = ShardLayout(SHAPES, 2)
    whole = whole_state(np.random.default_rng(0), layout.numel)
    held = split_state(whole, layout.bounds, layout.to_shards)  # what the D = 2 shards hold
    assert same(join_states(held, layout.from_shards), whole)
    assert not same(join_states(held, None), whole)  # the shards' order is a real permutation
    plain = split_state(whole, [(0, 200), (200, 650)], None)  # a plain run on two shards: contiguous slices
    assert np.array_equal(plain[1]["s"][1], whole["s"][1][200:])
    assert same(join_states(plain, None), whole)
    assert same(join_states(split_state(whole, ShardLayout(SHAPES, 5).bounds, ShardLayout(SHAPES, 5).to_shards),
                            ShardLayout(SHAPES, 5).from_shards), whole)  # fmt: skip


def test_the_cut_runs_coordinator_takes_the_drivers_notices_per_replica():
    """Its clients are replicas; the driver names worker ranks (rank = replica x D + d): rank 3 of
    R = 2 x D = 2 is replica 1's."""
    import asyncio

    from distrain.strategies.sandblaster_coordinator import LocalShards
    from distrain.strategies.sharded_sandblaster import ReplicaCoordinator

    async def verdict() -> set[int]:
        coordinator = ReplicaCoordinator(LocalShards([]), "gd", 4, False, 0.1, workers_per_replica=2)
        await coordinator.mark_slow([3])
        return coordinator.slow

    assert asyncio.run(verdict()) == {1}
