"""The warm pool's books (orchestrator/warm_pool.py), without Ray: how many it keeps, and that an
earlier Ray session's handles are never handed out."""

from __future__ import annotations

import pytest

from distrain.orchestrator import warm_pool


@pytest.fixture
def session(monkeypatch):
    current = {"name": "one"}
    monkeypatch.setattr(warm_pool, "_current_session", lambda: current["name"])
    monkeypatch.setattr(warm_pool, "_idle", {})
    return current


def test_keeps_only_as_many_as_the_capacity(session, monkeypatch):
    monkeypatch.setenv(warm_pool.WARM_ENV, "3")
    assert warm_pool.keep(["a", "b"], ["n1", "n2"]) == ["a", "b"]
    assert warm_pool.keep(["c", "d"], ["n1", "n1"]) == ["c"]  # room for one more
    assert warm_pool._idle_here() == {("worker", "n1"): ["a", "c"], ("worker", "n2"): ["b"]}


def test_each_kind_is_handed_out_only_for_its_own_kind(session, monkeypatch):
    monkeypatch.setenv(warm_pool.WARM_ENV, "3")
    assert warm_pool.keep(["w"], ["n1"]) == ["w"]
    assert warm_pool.keep(["s1", "s2", "s3"], ["n1", "n1", "n1"], kind="ps_shard/64") == ["s1", "s2"]  # one cap
    assert warm_pool._idle_here() == {("worker", "n1"): ["w"], ("ps_shard/64", "n1"): ["s1", "s2"]}
    monkeypatch.setattr(warm_pool.ray, "get", lambda ref, timeout=None: True)
    monkeypatch.setattr(warm_pool.ray, "is_initialized", lambda: True)

    class Pinged:
        def __init__(self, name):
            self.name = name
            self.alive = self

        def remote(self):
            return None

    warm_pool._idle_here()[("ps_shard/64", "n1")] = [Pinged("s1")]
    assert warm_pool.take("n1", kind="ps_shard/128") is None  # started with another max_concurrency
    assert warm_pool.take("n2", kind="ps_shard/64") is None  # not on that node
    assert warm_pool.take("n1", kind="ps_shard/64").name == "s1"
    assert warm_pool.idle_count(None) == 1 and warm_pool.idle_count("ps_shard/64") == 0


def test_a_new_session_forgets_the_old_handles(session):
    warm_pool.keep(["a"], ["n1"])
    session["name"] = "two"  # ray.shutdown() and ray.init() again: those actors are gone
    assert warm_pool._idle_here() == {}


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("5", 5), ("-1", 0), ("many", warm_pool.DEFAULT_CAPACITY)])
def test_capacity_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(warm_pool.WARM_ENV, value)
    assert warm_pool.capacity() == expected


def test_applies_only_to_cpu_workers_on_a_ray_that_outlives_the_run(monkeypatch):
    monkeypatch.delenv(warm_pool.WARM_ENV, raising=False)
    assert warm_pool.applies(uses_gpus=False, ray_ends_with_run=False)
    assert not warm_pool.applies(uses_gpus=True, ray_ends_with_run=False)
    assert not warm_pool.applies(uses_gpus=False, ray_ends_with_run=True)


def test_an_elastic_run_takes_and_keeps_no_shards_and_sends_the_idle_ones_away(session, monkeypatch):
    assert warm_pool.shards_apply(elastic=False) and not warm_pool.shards_apply(elastic=True)
    monkeypatch.setenv(warm_pool.WARM_ENV, "4")
    warm_pool.keep(["w"], ["n1"])
    warm_pool.keep(["s1", "s2"], ["n1", "n2"], kind="ps_shard/64")
    killed = []
    monkeypatch.setattr(warm_pool.ray, "kill", lambda actor, no_restart: killed.append(actor))
    warm_pool.release(keep_kind=warm_pool.WORKER)  # what run.py does before an elastic run
    assert sorted(killed) == ["s1", "s2"] and warm_pool._idle_here() == {("worker", "n1"): ["w"]}
    warm_pool.release()
    assert sorted(killed) == ["s1", "s2", "w"] and warm_pool._idle_here() == {}
