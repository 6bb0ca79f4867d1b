"""Shared fixtures: one real local Ray for the whole session, small and quiet."""

from __future__ import annotations

import os
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
