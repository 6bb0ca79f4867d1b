"""A worker's own error (bad data, a bug) is deterministic: the run fails once with it, never retried.

Issue 13: a truncated MNIST file used to be found only inside the worker actors' constructors, taken
for a dead worker, and retried (forever with --max-failures -1). The driver's preflight finds such
files now (tests/unit/test_datasets_files.py); these tests switch that check off to reach the workers'
own handling, which still matters when the files differ between the driver's node and a worker's.
"""

from __future__ import annotations

import json

import pytest

from distrain.errors import ConfigError
from distrain.orchestrator import run_checks
from distrain.orchestrator.recovery import Failure
from tests.unit.test_worker_errors import mnist, run

# ---------------------------------------------------------------- on a real Ray, the preflight switched off


@pytest.fixture
def no_preflight_data_check(monkeypatch):
    monkeypatch.setattr(run_checks, "check_dataset", lambda *args, **kwargs: None)  # preflight's check




def test_truncated_files_seen_only_by_the_workers_fail_once_with_the_one_line_error(
    ray_cluster, tmp_path, no_preflight_data_check
):
    data = mnist(tmp_path / "data", 200, 200, cut=1000)
    _, events, go = run(tmp_path, data, max_failures=-1)  # used to retry forever
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte is truncated") as info:
        go()
    assert "\n" not in str(info.value)
    assert not [e for e in events if isinstance(e, Failure)]  # never taken for a lost worker
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failures"] == 0
