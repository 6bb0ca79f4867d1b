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


# `make test` runs the suite (all but ALONE_FILES below) on two pytest-xdist workers, a file at a time
# (`--dist loadfile --no-loadscope-reorder`): each worker takes the next file in collection order when it
# is free. The files that take minutes go first, so that neither worker is left with one of them at the
# end while the other idles; then the other integration files, then the unit files (many small ones,
# which fill in around the long ones). Slowest first: from CI's --durations where it listed them (main
# 09ad6c9), by how many runs they start otherwise.
SLOWEST_FILES = [
    "test_fault_tolerance.py",
    "test_pipeline_runs.py",
    "test_tune.py",
    "test_user_task_acceptance.py",
    "test_sandblaster_runs.py",
    "test_ps_runs.py",
    "test_report.py",
    "test_signals.py",
    "test_compression_collective.py",
]


# Files whose tests fail when another test competes with them for the 2 cores: churn on a simulated cluster
# (ray.cluster_utils.Cluster) that counts every leave and join, where a starved worker is declared hung
# (--hang-timeout-s 30) and a starved raylet lost (1.5 s health checks), each an extra leave and join
# (seen at load 17-26 on a shared machine). They are marked `alone`; `make test` runs them after the
# two-worker part, one test at a time.
ALONE_FILES = [
    "test_elastic.py",
    "test_elastic_bsp.py",
    "test_elastic_collective.py",
]


def _schedule_rank(item) -> tuple[int, int]:
    path = Path(item.path)
    if INTEGRATION_DIR not in path.parents:
        return (2, 0)
    if path.name in SLOWEST_FILES:
        return (0, SLOWEST_FILES.index(path.name))
    return (1, 0)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION_DIR in Path(item.path).parents or "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
        if INTEGRATION_DIR in Path(item.path).parents and Path(item.path).name in ALONE_FILES:
            item.add_marker(pytest.mark.alone)
    items.sort(key=_schedule_rank)  # stable: a file's tests stay together and in their order
