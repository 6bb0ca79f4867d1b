"""Placement on a simulated two-node Ray cluster (ray.cluster_utils.Cluster).

The cluster runs in a subprocess: a test process can hold only one Ray connection, and the other
tests share the session's single-node Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration  # a two-node Ray in a subprocess: tens of seconds

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import ray
    from ray.cluster_utils import Cluster
    from distrain.config import RunConfig
    from distrain.orchestrator.run import run_training

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
    cluster.add_node(num_cpus=3)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    out = {"nodes": nodes}
    with tempfile.TemporaryDirectory() as tmp:
        small = dict(epochs=1, max_steps=4, segment_steps=2)
        r = run_training(RunConfig(workers=2, placement="spread", run_dir=f"{tmp}/spread", **small))
        out["spread"] = [i["node_id"] for i in r.worker_info]
        out["spread_summary"] = r.summary
        r = run_training(RunConfig(workers=2, placement="pack", run_dir=f"{tmp}/pack", **small))
        out["pack"] = [i["node_id"] for i in r.worker_info]
        r = run_training(
            RunConfig(strategy="ssp", workers=2, ps_shards=1, placement="pack", run_dir=f"{tmp}/ps", **small)
        )
        out["ps_workers"] = [i["node_id"] for i in r.worker_info]
        out["ps_shards"] = r.shard_nodes
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


def test_spread_places_workers_on_both_nodes_and_shards_avoid_busy_nodes(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert len(out["nodes"]) == 2
    assert sorted(out["spread"]) == out["nodes"]  # one worker on each node
    assert out["spread_summary"]["status"] == "completed" and out["spread_summary"]["steps_completed"] == 4
    assert len(set(out["pack"])) == 1  # both workers on one node
    assert len(set(out["ps_workers"])) == 1
    assert out["ps_shards"] and out["ps_shards"][0] not in out["ps_workers"]  # the shard went to the idle node
