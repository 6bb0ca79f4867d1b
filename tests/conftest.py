"""Shared fixtures: one real local Ray for the whole session, small and quiet."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# No `still ...` lines in piped output (run_progress.py): on a slow machine they would land among the
# lines tests compare; the tests of those lines set their own interval.
os.environ.setdefault("DISTRAIN_PROGRESS_EVERY_S", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray with 8 logical CPUs (2 cores here): room for 4 workers and their PS shards.

    Started exactly as `distrain run` starts its own (same system config)."""
    import ray

    from distrain.orchestrator.cluster import RayConnection, start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=8)
    yield ray
    RayConnection(started_here=True).close()  # as a run stops its own: every process, and its marker


RETURN_WAIT_S = 60.0  # actors and placement groups are removed asynchronously; a few seconds at most when idle


def _cpus_held(ray) -> float:
    return ray.cluster_resources().get("CPU", 0.0) - ray.available_resources().get("CPU", 0.0)


def _wait_for_free_cpus(ray, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _cpus_held(ray) > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _clear_cluster(ray) -> str:
    """Remove every placement group and kill every live actor (warm ones included); what was found."""
    from ray._raylet import ActorID, PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    from distrain.orchestrator import warm_pool

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    actors = {i: a for i, a in ray._private.state.actors().items() if a["State"] != "DEAD"}
    warm_pool.release()
    for group in groups:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group["placement_group_id"]))))
    core = ray._private.worker.global_worker.core_worker
    for actor_id in actors:
        try:
            core.kill_actor(ActorID(bytes.fromhex(actor_id)), True)
        except Exception:  # noqa: BLE001 - died meanwhile
            pass
    names = sorted(f"{a['ActorClassName']} (pid {a['Pid']})" for a in actors.values())
    return f"placement groups {[g['bundles'] for g in groups]}, live actors {names}"


@pytest.fixture(autouse=True)
def _cluster_handed_back(request):
    """After each test on the shared cluster: every CPU is free again. A test that leaves actors or a
    placement group holding CPUs fails here, by name, and the cluster is cleared for the tests that follow
    (a CI run once lost 11 later tests, none of them the culprit, to one CPU held for the rest of the session)."""
    yield
    if "ray_cluster" not in request.fixturenames:
        return
    import ray

    if not ray.is_initialized() or _wait_for_free_cpus(ray, RETURN_WAIT_S):
        return
    held = _cpus_held(ray)
    found = _clear_cluster(ray)
    _wait_for_free_cpus(ray, RETURN_WAIT_S)
    pytest.fail(f"{held:g} CPUs still held {RETURN_WAIT_S:.0f}s after the test: {found}")


# Two layers, one folder each: tests/unit (no Ray, no process groups, a minute or two in all) and
# tests/integration, which start a real Ray, real torch.distributed ranks or other processes. Every test
# under tests/integration is marked `integration`, and so is any test that uses the shared Ray cluster
# (tests/unit/test_layers.py checks that the folders and the marker agree); `pytest tests/unit` or
# `pytest -m "not integration"` runs the fast layer alone, `make test` runs both.
INTEGRATION_DIR = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION_DIR in Path(item.path).parents or "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
