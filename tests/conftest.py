"""Shared fixtures: one real local Ray for the whole session, small and quiet."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray with 8 logical CPUs (2 cores here): room for 4 workers and their PS shards."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()
