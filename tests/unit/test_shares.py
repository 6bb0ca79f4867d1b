"""Heterogeneous workers' shares (trainers/shares.py): the cut of a global batch, the data plan's blocks,
and the gradient weight that makes unequal batches' mean the whole batch's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.shares import gradient_weight, share_bounds, split_batch


def test_split_is_proportional_by_largest_remainder_and_each_part_is_at_least_one():
    assert split_batch(64, [3, 1]) == (48, 16)
    assert split_batch(10, [1, 1, 1]) == (4, 3, 3)  # the remainder's tie goes to the lower rank
    assert split_batch(8, [1, 1, 2]) == (2, 2, 4)
    assert split_batch(4, [1000, 1, 1, 1]) == (1, 1, 1, 1)  # a part rounding to 0 takes one from the largest
    assert split_batch(10, [100, 1]) == (9, 1)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        total = int(rng.integers(n, 300))
        weights = list(rng.uniform(0.05, 5.0, n))
        parts = split_batch(total, weights)
        assert sum(parts) == total and min(parts) >= 1
        ideal = np.array(weights) / sum(weights) * total
        if all(ideal >= 1):  # no part was raised to 1: each within one sample of its exact share
            assert np.abs(np.array(parts) - ideal).max() < 1


@pytest.mark.parametrize(("total", "weights"), [(1, [1, 1]), (8, [1, 0]), (8, [1, -2]), (8, [1, float("nan")])])
def test_split_refuses_what_cannot_be_cut(total, weights):
    with pytest.raises(ConfigError):
        split_batch(total, weights)


def test_blocks_cut_each_step_in_rank_order_and_an_epoch_is_seen_exactly_once():
    sharder = EpochSharder(num_samples=200, global_batch=16, seed=4)
    shares = split_batch(16, [3, 1, 2])
    seen = []
    for step in range(sharder.steps_per_epoch):
        blocks = [sharder.worker_indices(1, step, r, 3, shares) for r in range(3)]
        assert [len(b) for b in blocks] == list(shares)
        assert np.array_equal(np.concatenate(blocks), sharder.global_batch_indices(1, step))
        seen.extend(np.concatenate(blocks))
    assert len(seen) == len(set(seen)) == sharder.steps_per_epoch * 16
    assert share_bounds(shares, 2) == (shares[0] + shares[1], 16)
    with pytest.raises(ValueError, match="do not cut"):
        sharder.worker_indices(1, 0, 0, 3, (8, 8))


def test_weighted_mean_of_unequal_batches_is_the_whole_batch_mean():
    rng = np.random.default_rng(1)
    per_sample = rng.normal(size=(64, 5))  # one "gradient" per sample
    shares = split_batch(64, [3, 1])
    means, start = [], 0
    for b in shares:
        means.append(per_sample[start : start + b].mean(axis=0) * gradient_weight(b, len(shares), 64))
        start += b
    assert np.allclose(np.mean(means, axis=0), per_sample.mean(axis=0), atol=1e-12)
    assert not np.allclose(np.mean([per_sample[:48].mean(0), per_sample[48:].mean(0)], axis=0), per_sample.mean(0))


def test_the_config_gives_each_worker_its_share_of_the_global_batch():
    assert RunConfig(workers=2, batch_size=32, worker_weights="3,1").worker_shares == (48, 16)
    assert RunConfig(workers=3, batch_size=10, worker_weights="1, 1, 2").worker_shares == (8, 7, 15)
    assert RunConfig(workers=2).worker_shares is None


def test_a_pipelines_replicas_take_whole_sets_of_their_micro_batches():
    """One weight per replica; each share a multiple of P = --microbatches x --accumulate-steps, so a
    replica's micro-batches stay one size (torch's schedules receive into buffers of the first one's
    shape) and the schedule's mean over them is the mean over the replica's samples."""
    pipe = dict(model="mlp", workers=2, batch_size=32, pipeline_stages=2, microbatches=4)
    assert RunConfig(**pipe, worker_weights="3,1").worker_shares == (48, 16)
    assert RunConfig(**pipe, worker_weights="2,1").worker_shares == (44, 20)  # not 43/21: 11 and 5 sets of 4
    assert RunConfig(**pipe, worker_weights="2,1", accumulate_steps=2).worker_shares == (88, 40)  # P = 8
    assert RunConfig(**pipe, worker_weights="1000,1").worker_shares == (60, 4)  # each replica one set at least
    three = RunConfig(**(pipe | dict(workers=3, microbatches=8)), worker_weights="1,1,2").worker_shares
    assert three == (24, 24, 48) and all(b % 8 == 0 for b in three)
    with pytest.raises(ConfigError, match="gives 4 weights for 2 pipeline replicas"):
        RunConfig(**pipe, worker_weights="3,1,3,1")


def test_the_report_shows_each_workers_share():
    import pandas as pd

    from distrain.reporting.report import Run, table_rows

    summary = {"workers": 2, "worker_shares": [48, 16], "status": "completed"}
    run = Run(Path("r"), "r", {"strategy": "bsp", "workers": 2}, summary, pd.DataFrame())
    assert table_rows([run])[0][2] == "2 (b=48/16)"
    plain = Run(Path("p"), "p", {"strategy": "bsp", "workers": 2}, {"workers": 2}, pd.DataFrame())
    assert table_rows([plain])[0][2] == "2"


def test_the_planner_predicts_a_step_under_worker_speeds_and_recommends_proportional_shares():
    from distrain.planning.heterogeneous import parse_worker_speeds, share_effect

    effect = share_effect(0.010, 32, parse_worker_speeds("1,1,0.5"))
    assert effect.equal_shares == (32, 32, 32) and effect.shares == (39, 38, 19)
    assert effect.equal_step_s == pytest.approx(0.020)  # the half-speed worker's 32 samples
    assert effect.balanced_step_s == pytest.approx(max(39 / 32 * 0.010, 19 / 32 * 0.010 / 0.5))
    assert effect.speedup == pytest.approx(0.020 / effect.balanced_step_s) and effect.speedup > 1.5
    assert "--worker-weights 1,1,0.5" in effect.text() and "39/38/19" in effect.text()
    for bad in ("1,0", "1,x", "", "1,-2"):
        with pytest.raises(ConfigError, match="--worker-speeds"):
            parse_worker_speeds(bad)


def test_cut_replicas_take_one_share_each_in_multiples_of_their_data_parallel_ranks():
    """--fsdp D: one weight per replica, each share a multiple of D (its D ranks split it equally; x k
    under --accumulate-steps k, so each rank's part cuts into its micro-batches); a hybrid plan's D x T
    workers each take their own samples (unit D x T); tensor-parallel workers that share a slice add
    nothing to the unit."""
    from distrain.config.shares_section import share_unit

    cut = dict(model="mlp", workers=2, fsdp=2, batch_size=16)
    assert RunConfig(**cut, worker_weights="3,1").worker_shares == (48, 16)
    assert share_unit(RunConfig(**cut)) == 2
    assert RunConfig(**cut, worker_weights="2,1").worker_shares == (42, 22)  # 21/11 units of 2, not 43/21
    assert RunConfig(**cut, worker_weights="1000,1").worker_shares == (62, 2)  # one unit at least
    accumulated = RunConfig(**cut, worker_weights="1000,1", accumulate_steps=2)  # B = 128, each rank's part in 2
    assert share_unit(accumulated) == 4 and accumulated.worker_shares == (124, 4)
    tp = RunConfig(model="mlp", workers=2, tensor_parallel=2, batch_size=32, worker_weights="2,1")
    assert share_unit(tp) == 1 and tp.worker_shares == (43, 21)
    hybrid = RunConfig(model="cnn", workers=2, fsdp=2, tensor_parallel=2, batch_size=8, worker_weights="2,1")
    assert share_unit(hybrid) == 4 and hybrid.worker_shares == (44, 20)
    for config in (RunConfig(**cut, worker_weights="3,1"), RunConfig(**cut, balance="speed"), tp, hybrid):
        config.validate()


def test_a_cut_replicas_block_is_split_equally_among_its_ranks_and_an_epoch_is_seen_once():
    """The data plan with a cut: 2 replicas' shares (48, 16) of 64, each block cut into D = 2 equal parts
    in rank order, so rank (r, d) takes part d of replica r's block; the 4 parts tile each step."""
    sharder = EpochSharder(num_samples=200, global_batch=64, seed=4)
    seen = []
    for step in range(sharder.steps_per_epoch):
        parts = [sharder.worker_indices(0, step, s, 4, (48, 16), cut=2) for s in range(4)]
        assert [len(p) for p in parts] == [24, 24, 8, 8]
        assert np.array_equal(np.concatenate(parts), sharder.global_batch_indices(0, step))
        assert np.array_equal(np.concatenate(parts[:2]), sharder.worker_indices(0, step, 0, 2, (48, 16)))
        seen.extend(np.concatenate(parts))
    assert len(seen) == len(set(seen)) == sharder.steps_per_epoch * 64
    with pytest.raises(ValueError, match="does not split into 2 equal parts"):
        sharder.worker_indices(0, 0, 0, 4, (47, 17), cut=2)
    with pytest.raises(ValueError, match="do not cut"):
        sharder.worker_indices(0, 0, 0, 4, (48, 16))  # one share per replica needs the cut


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (dict(worker_weights="3,1,1,1"), r"^--worker-weights '3,1,1,1' gives 4 weights for 2 cut replicas \(--work"),
        (dict(worker_weights="3,1", transport="ps", ps_shards=2), r"across cut replicas .* collective transport only"),
        (dict(balance="speed", strategy="async", transport="ps", ps_shards=2), r"collective transport only"),
        (dict(balance="speed", pipeline_stages=2), r"with --pipeline-stages and --fsdp/--tensor-parallel together"),
        # (--balance speed under a range is accepted: tests/unit/test_elastic_shares.py; static weights are not)
        (dict(worker_weights="3,1,1", workers="2..3"), r"^--worker-weights 3,1,1 does not compose with --workers MIN"),
    ],
)
def test_what_cut_replicas_refuse_with_unequal_shares_in_one_line(given, message):
    base = dict(model="mlp", workers=2, fsdp=2, batch_size=16)
    with pytest.raises(ConfigError, match=message) as caught:
        RunConfig(**(base | given)).validate()
    assert "\n" not in str(caught.value)
