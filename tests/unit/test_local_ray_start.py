"""start_local_ray hands Ray a fresh copy of its system config each time (unit: Ray's init is stubbed).

Ray 2.60 writes the session's object-spilling directory into the `_system_config` dict it is given
(ray/_private/node.py: `_ray_params._system_config["object_spilling_config"] = ...`). Passed the module's
own dict, a second `distrain.fit` in the same process started its Ray with the first session's (deleted)
spilling directory and a warning about an unstable API."""

from __future__ import annotations

from distrain.orchestrator import cluster


def test_each_local_start_gets_the_system_config_as_written(monkeypatch):
    given: list[dict] = []

    def init(*, _system_config, **kwargs):  # what Ray's Node does to the dict it is handed
        given.append(dict(_system_config))
        _system_config["object_spilling_config"] = '{"type": "filesystem", "params": {"directory_path": "/tmp/s1"}}'

    monkeypatch.setattr(cluster.ray, "init", init)
    monkeypatch.setattr(cluster.leftovers, "stop_orphaned", lambda: 0)
    monkeypatch.setattr(cluster, "_local_node", lambda: None)
    written = dict(cluster.LOCAL_SYSTEM_CONFIG)
    cluster.start_local_ray(num_cpus=2)
    cluster.start_local_ray(num_cpus=2)
    assert given == [written, written]
    assert cluster.LOCAL_SYSTEM_CONFIG == written


def test_local_ray_runs_its_workers_at_nice_zero():
    """Ray renices its workers to 15 unless told otherwise; a BSP step then loses its CPU to any other process."""
    assert cluster.LOCAL_SYSTEM_CONFIG["worker_niceness"] == 0


def _cluster_config(monkeypatch, config):
    monkeypatch.setattr(cluster.ray._private.state.state, "get_system_config", lambda: dict(config))


def test_workers_ask_for_nice_zero_on_a_ray_started_elsewhere(monkeypatch):
    from distrain.config import RunConfig
    from distrain.orchestrator.controller.ray_group import worker_env

    _cluster_config(monkeypatch, {})  # e.g. `ray start`, or a script's own ray.init: Ray's 15
    assert cluster.worker_niceness_env() == {"RAY_worker_niceness": "0"}
    assert worker_env(RunConfig()) == {"runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}}
    # On a Ray started as distrain starts one every worker process is at 0 already: Ray's ready ones serve.
    _cluster_config(monkeypatch, cluster.LOCAL_SYSTEM_CONFIG)
    assert cluster.worker_niceness_env() == {}
    assert worker_env(RunConfig()) == {}


def test_storage_credentials_and_niceness_share_the_runtime_env(monkeypatch):
    from distrain.config import RunConfig
    from distrain.orchestrator import storage
    from distrain.orchestrator.controller.ray_group import worker_env

    _cluster_config(monkeypatch, {"worker_niceness": 5})
    monkeypatch.setattr(storage, "aws_environment", lambda: {"AWS_REGION": "eu-north-1"})
    sharded = RunConfig(storage="s3://bucket/runs", fsdp=2, workers=2)
    env = worker_env(sharded)["runtime_env"]["env_vars"]
    assert env == {"RAY_worker_niceness": "0", "AWS_REGION": "eu-north-1"}
