"""Where a worker actor sits in a run's grid of R replicas x S pipeline stages x D FSDP shards x T
tensor-parallel workers, from its rank (config/layout_section.py documents the grid; the strategies and
the worker ask here). Pure arithmetic: no torch, no config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GridPosition:
    """Where one worker actor sits in the run's grid of R replicas x S stages x D shards x T workers."""

    replica: int
    stage: int
    shard: int
    tp: int

    def data_rank(self, shards: int) -> int:
        """Its data-parallel rank, replica x D + shard: the slice of each step's samples it takes (a
        pipeline's S stages of one shard all read it)."""
        return self.replica * shards + self.shard


def grid_position(rank: int, shards: int, tp: int, stages: int) -> GridPosition:
    """Actor `rank`'s place, rank = ((replica x S + stage) x D + shard) x T + tp. The innermost groups talk
    most: a tensor-parallel group's T workers every layer, a stage's D shards (FSDP) every layer they
    gather, a replica's S stages every micro-batch; replicas once per step. Without stages (S = 1) this is
    ShardedBSP's (replica x D + shard) x T + tp, without shards PipelineBSP's replica x S + stage."""
    rest, tp_rank = divmod(rank, tp)
    rest, shard = divmod(rest, shards)
    replica, stage = divmod(rest, stages)
    return GridPosition(replica, stage, shard, tp_rank)
