"""--balance speed over a pipeline's replicas (orchestrator/pipeline_balance.py) on plain step times:
shares in whole sets of micro-batches, each replica as slow as its slowest stage."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.pipeline_balance import PipelineShareBalancer


def feed(balancer: PipelineShareBalancer, per_sample: list[list[float]], rows: int) -> None:
    """`rows` steps: actor (replica r, stage s) takes its replica's share x per_sample[r][s] seconds, every
    stage's row carrying the replica's samples (`replica_samples`) and only the last stage's `samples`."""
    S = balancer.stages
    for _ in range(rows):
        shares = [u * balancer.unit for u in balancer.current]
        workers = [r * S + s for r in range(len(per_sample)) for s in range(S)]
        balancer.add_rows(
            {
                "worker": workers,
                "compute_s": [shares[a // S] * per_sample[a // S][a % S] for a in workers],
                "replica_samples": [shares[a // S] for a in workers],
                "samples": [shares[a // S] if a % S == S - 1 else 0 for a in workers],
            }
        )


def test_a_replica_whose_first_stage_is_three_times_slower_gets_a_quarter_in_whole_micro_batch_sets():
    """R = 2 replicas of S = 2 stages, P = 4 micro-batches, B = 64: replica 1's stage 0 computes 3x slower
    per sample (its last stage is not slower: only the slowest stage tells). The move is to 48/16, each a
    multiple of 4, and the rows that took the old shares do not move it again."""
    balancer = PipelineShareBalancer(replicas=2, stages=2, unit=4, global_batch=64)
    assert balancer.shares_for(0) == (32, 32)
    slow = [[0.001, 0.001], [0.003, 0.001]]
    feed(balancer, slow, rows=9)
    assert balancer.shares_for(9) == (32, 32)  # too few rows to judge
    feed(balancer, slow, rows=1)
    assert balancer.shares_for(10) == (48, 16)
    assert balancer.moves == [{"step": 10, "shares": [48, 16]}]
    feed(balancer, slow, rows=20)
    assert balancer.shares_for(30) == (48, 16)
    assert balancer.summary() == {"final_shares": [48, 16], "moves": [{"step": 10, "shares": [48, 16]}]}


def test_pipeline_shares_are_always_whole_sets_of_micro_batches():
    """Speeds 1 : 1.7 per sample would cut 64 at 40.3/23.7; in sets of P = 8 the shares are 40/24."""
    balancer = PipelineShareBalancer(replicas=2, stages=3, unit=8, global_batch=64, initial=(32, 32))
    feed(balancer, [[0.001] * 3, [0.0017] * 3], rows=10)
    assert balancer.shares_for(10) == (32, 32)  # a gain under `at_once`: confirmed on a window of new rows
    feed(balancer, [[0.001] * 3, [0.0017] * 3], rows=20)
    shares = balancer.shares_for(20)
    assert all(b % 8 == 0 for b in shares) and sum(shares) == 64 and shares == (40, 24)


def test_equal_replicas_stay_equal():
    balancer = PipelineShareBalancer(replicas=2, stages=2, unit=4, global_batch=64, initial=(32, 32))
    for segment in range(10):
        feed(balancer, [[0.001, 0.0011], [0.0011, 0.001]], rows=4)
        assert balancer.shares_for(4 * segment) == (32, 32)
    assert balancer.moves == []


def test_a_global_batch_that_is_not_whole_sets_is_refused():
    with pytest.raises(ValueError, match="not whole sets of 4"):
        PipelineShareBalancer(replicas=2, stages=2, unit=4, global_batch=66)


def test_balance_speed_with_pipeline_stages_is_accepted():
    """--balance speed --pipeline-stages 2 --workers 2 (it was refused before the pipeline balancer)."""
    config = RunConfig(balance="speed", pipeline_stages=2, workers=2, batch_size=32, microbatches=4)
    config.validate()
    assert config.worker_shares is None  # equal until measured


def test_cut_replicas_are_balanced_as_their_slowest_worker_in_units_of_their_data_parallel_ranks():
    """The same balancer over cut replicas (orchestrator/controller/attempt.py makes it for any replica of
    several workers): R = 2 replicas of D x T = 2 x 2 workers (ranks r x 4 ..), unit D = 2, B = 64. One
    worker of replica 1 computes 3x slower per sample: the replica is as slow as that worker, and the
    shares move to 48/16, multiples of 2."""
    balancer = PipelineShareBalancer(replicas=2, stages=4, unit=2, global_batch=64)
    assert balancer.shares_for(0) == (32, 32)
    feed(balancer, [[0.001] * 4, [0.001, 0.001, 0.003, 0.001]], rows=10)
    shares = balancer.shares_for(10)
    assert shares == (48, 16) and all(b % 2 == 0 for b in shares)
