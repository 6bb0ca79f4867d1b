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
