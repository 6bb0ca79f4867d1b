"""Shared fixtures: one real local Ray for the whole session, small and quiet."""

from __future__ import annotations

import os

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


# Two layers: unit tests (no Ray, no process groups, seconds in all) and integration tests, which start
# a real Ray or real torch.distributed ranks. A test is integration when it uses the shared Ray cluster
# or its module says so (`pytestmark = pytest.mark.integration`); `pytest -m "not integration"` runs the
# fast layer alone, `make test` runs both.
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
