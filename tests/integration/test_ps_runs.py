"""Parameter-server strategies end to end on real Ray shard actors."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import assert_compact_checkpoint, final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        optimizer="sgd", momentum=0.0, lr=0.1, lr_scaling="none", epochs=2, max_steps=30, seed=5,
        workers=2, batch_size=16, segment_steps=8, run_dir=str(tmp_path / name),
    )  # fmt: skip
    return RunConfig(**(base | kw))



@pytest.fixture(scope="module")
def allreduce(tmp_path_factory):
    """The all-reduce runs several tests compare against, each run once: plain SGD and momentum SGD."""
    base = tmp_path_factory.mktemp("allreduce")
    return {
        name: final_params(run_training(cfg(base, name, **kw)).run_dir)
        for name, kw in (("sgd", {}), ("momentum", dict(momentum=0.9)))
    }


def test_ssp_zero_and_bsp_over_ps_equal_bsp_allreduce(tmp_path, allreduce):
    bsp_ps = run_training(cfg(tmp_path, "bsp-ps", transport="ps", ps_shards=2))
    ssp0 = run_training(cfg(tmp_path, "ssp0", strategy="ssp", staleness=0, ps_shards=3))
    assert (final_params(bsp_ps.run_dir) - allreduce["sgd"]).abs().max().item() <= 1e-5
    assert (final_params(ssp0.run_dir) - allreduce["sgd"]).abs().max().item() <= 1e-5
    rows = steps_of(ssp0.run_dir, sort_by=None)
    assert (rows["staleness"] <= 1).all()  # N=2 pushes per clock: the second is one version late
    assert len(rows) == 30 * 2


def test_bsp_over_ps_equals_allreduce_with_momentum_and_adam(tmp_path, allreduce):
    for opt in (dict(momentum=0.9), dict(optimizer="adam", momentum=None, lr=0.01)):  # adam takes no momentum
        name = opt.get("optimizer", "sgd")
        if name == "sgd":
            a = allreduce["momentum"]
        else:
            a = final_params(run_training(cfg(tmp_path, f"ar-{name}", **opt)).run_dir)
        b = final_params(run_training(cfg(tmp_path, f"ps-{name}", transport="ps", ps_shards=2, **opt)).run_dir)
        assert (a - b).abs().max().item() <= 1e-5, name


def test_ssp_staleness_bound_holds_at_every_pull_and_is_reached(tmp_path):
    s = 1
    run = run_training(
        cfg(tmp_path, "ssp", strategy="ssp", staleness=s, workers=3, batch_size=8, max_steps=40,
            straggler=["0:0.02"], ps_shards=2)
    )  # fmt: skip
    rows = steps_of(run.run_dir, sort_by=None)
    lead = rows["clock"] - rows["min_clock"]
    assert len(rows) == 3 * 40
    assert (lead <= s).all(), lead.max()
    assert (lead == s).any()  # the bound was actually hit ...
    fast = rows[rows["worker"] != 0]
    assert (fast["wait_s"] > 0.005).sum() >= 10  # ... and the fast workers waited for the straggler
    assert run.summary["wait_s_total"] > 0.2
    assert run.summary["staleness_max"] >= 1


def test_async_with_a_straggler_reaches_accuracy_and_sees_staleness(tmp_path):
    run = run_training(
        RunConfig(strategy="async", workers=3, ps_shards=2, straggler=["1:0.01"], run_dir=str(tmp_path / "async"))
    )
    summary = run.summary
    assert summary["final_test_accuracy"] >= 0.93
    assert summary["staleness_max"] > 0 and summary["staleness_p95"] > 0
    rows = steps_of(run.run_dir, sort_by=None)
    per_worker = rows.groupby("worker").size()
    assert per_worker[1] < per_worker.drop(1).min()  # the straggler took fewer units: nobody waited for it
    units = rows.groupby(["step", "slice"]).size()
    assert (units == 1).all() and len(units) == summary["steps_completed"] * 3  # every unit exactly once
    assert (rows["wait_s"] == 0).all()  # async never blocks
    assert summary["bytes_pushed_per_step"] == summary["bytes_pulled_per_step"] > 0


def test_checkpoint_moves_between_transports(tmp_path, allreduce):
    """15 steps BSP-over-PS, then 15 more all-reduce from its checkpoint == 30 steps all-reduce (the
    module's straight runs: 30 steps each)."""
    kw = dict(momentum=0.9)
    first = run_training(cfg(tmp_path, "first", transport="ps", ps_shards=2, **(kw | {"max_steps": 15})))
    assert_compact_checkpoint(first.run_dir / "checkpoints" / "final.pt")  # the shards' snapshot, compact
    second = run_training(cfg(tmp_path, "second", init_from=str(first.run_dir / "checkpoints" / "final.pt"), **kw))
    assert second.summary["steps_completed"] == 30
    assert (final_params(second.run_dir) - allreduce["momentum"]).abs().max().item() <= 1e-5
    # and back: all-reduce checkpoint at 15 steps into SSP(0) for the rest equals the straight run too
    head = run_training(cfg(tmp_path, "head", max_steps=15))
    tail = run_training(
        cfg(tmp_path, "tail", strategy="ssp", staleness=0, init_from=str(head.run_dir / "checkpoints" / "final.pt"))
    )
    assert (final_params(tail.run_dir) - allreduce["sgd"]).abs().max().item() <= 1e-5
