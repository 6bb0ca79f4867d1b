"""Warm parameter-server shards (orchestrator/warm_pool.py, strategies/ps_shard_group.py): the next PS run
in a Ray session takes a completed run's shard processes, and trains exactly as fresh shards would, even
when its optimizer, rate and number of shards differ (a rebuilt shard keeps nothing of the last run)."""

from __future__ import annotations

import textwrap
import time

import pytest
import ray

import distrain
from distrain.config import RunConfig
from distrain.orchestrator import warm_pool
from distrain.orchestrator.run import run_training
from tests.helpers import final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")

SHARDS = "ps_shard/64"  # the pool kind of a small run's shards (their max_concurrency: 64)


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        transport="ps", optimizer="sgd", momentum=0.9, lr=0.1, lr_scaling="none", epochs=1, max_steps=6, seed=5,
        workers=2, batch_size=16, segment_steps=3, ps_shards=3, run_dir=str(tmp_path / name),
    )  # fmt: skip
    return RunConfig(**(base | kw))


def shard_actors_alive() -> set[str]:
    actors = ray._private.state.actors()
    return {i for i, a in actors.items() if a["ActorClassName"] == "ParameterShard" and a["State"] != "DEAD"}


def wait_for_all_cpus() -> None:
    """Kept idle, shards hold no CPU: the run's groups held their CPUs and are gone."""
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.time() < deadline, ray.available_resources()
        time.sleep(0.2)


def test_the_next_ps_run_takes_the_warm_shards_and_trains_as_fresh_ones_would(tmp_path, monkeypatch):
    warm_pool.release()
    before = shard_actors_alive()
    taken = warm_pool.taken(SHARDS)
    run_training(cfg(tmp_path, "first"))  # momentum SGD, 3 shards: state the next run must not see
    kept = shard_actors_alive() - before
    assert len(kept) == 3 and warm_pool.idle_count(SHARDS) == 3 and warm_pool.taken(SHARDS) == taken
    wait_for_all_cpus()

    other = dict(optimizer="adam", momentum=None, lr=0.01, ps_shards=2)  # other optimizer, rate, slices
    warm = run_training(cfg(tmp_path, "warm", **other))
    assert warm_pool.taken(SHARDS) == taken + 2  # both shards were the first run's processes
    assert warm.summary["status"] == "completed"
    assert shard_actors_alive() - before == kept  # the same processes, none new: kept again, all three
    wait_for_all_cpus()

    monkeypatch.setenv(warm_pool.WARM_ENV, "0")  # the reference: fresh shards (and workers)
    warm_pool.release()
    fresh = run_training(cfg(tmp_path, "fresh", **other))
    assert warm_pool.taken(SHARDS) == taken + 2 and warm_pool.idle_count(None) == 0
    assert (final_params(warm.run_dir) - final_params(fresh.run_dir)).abs().max().item() <= 1e-6
    assert warm.shard_nodes == fresh.shard_nodes


FAILING = textwrap.dedent(
    """
    import torch
    from torch.utils.data import TensorDataset

    import distrain


    class Failing(distrain.Task):
        calls = 0

        def build_model(self):
            return torch.nn.Linear(4, 1)

        def datasets(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, 4, generator=g)
            return TensorDataset(x[:192], x[:192].sum(1)), TensorDataset(x[192:], x[192:].sum(1))

        def loss(self, model, batch):  # at a worker's third step (the driver's checks call it less)
            Failing.calls += 1
            if Failing.calls == 3:
                raise ValueError("the user's own bug")
            x, y = batch
            return ((model(x).squeeze(-1) - y) ** 2).mean()
    """
)


def test_a_failed_ps_runs_shards_are_not_kept(tmp_path):
    task_file = tmp_path / "failing.py"
    task_file.write_text(FAILING)
    warm_pool.release()
    before = shard_actors_alive()
    with pytest.raises(ValueError, match="the user's own bug"):
        distrain.fit(
            f"{task_file}:Failing", workers=2, epochs=1, transport="ps", ps_shards=2,
            run_dir=str(tmp_path / "failed"), progress=False,
        )  # fmt: skip
    assert warm_pool.idle_count(None) == 0
    deadline = time.time() + 30
    while shard_actors_alive() - before:  # killed as before
        assert time.time() < deadline
        time.sleep(0.2)


def test_an_elastic_ps_run_starts_fresh_shards_keeps_none_and_ends_the_idle_ones(tmp_path):
    """--workers MIN..MAX re-places workers as nodes come and go; kept shards (zero-CPU, pinned to the node
    of a bundle they outlive) would be one more thing moving under it. So an elastic run ends the idle shards
    first, starts its own fresh and keeps none."""
    warm_pool.release()
    before = shard_actors_alive()
    run_training(cfg(tmp_path, "fixed", ps_shards=2))
    kept = shard_actors_alive() - before
    assert len(kept) == 2 and warm_pool.idle_count(SHARDS) == 2
    taken = warm_pool.taken(SHARDS)
    elastic = run_training(cfg(tmp_path, "elastic", strategy="bsp", workers="1..2", ps_shards=2))
    assert elastic.summary["status"] == "completed"
    assert warm_pool.taken(SHARDS) == taken and warm_pool.idle_count(SHARDS) == 0
    assert warm_pool.idle_count() >= 1  # its workers are kept as before
    deadline = time.time() + 30
    while shard_actors_alive() - before:  # the idle ones killed before it started, its own after it ended
        assert time.time() < deadline, shard_actors_alive() - before
        time.sleep(0.2)
