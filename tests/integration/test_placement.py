"""Placement on a simulated two-node Ray cluster (ray.cluster_utils.Cluster): data-parallel workers
packed and spread, PS shards on the idle node, pipeline replicas on different nodes (a killed stage
restarting across the replicas' placement groups).

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
    import ray, torch
    from ray.cluster_utils import Cluster
    from distrain.config import RunConfig
    from distrain.orchestrator.run import run_training

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    cluster.add_node(num_cpus=4)  # room for both of a pipeline's replicas on one node: spreading is a choice
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
        # A pipeline, S = 2 x R = 2 (one placement group per replica), with stage 1 of replica 0 killed:
        # the restart reserves the groups again and ends where an unbroken run would.
        pipe = dict(epochs=1, segment_steps=2, workers=2, pipeline_stages=2, microbatches=2, optimizer="sgd",
                    momentum=0.0, lr_scaling="none", eval_every=0, checkpoint_steps=2)
        r = run_training(RunConfig(max_steps=6, chaos=["kill-worker@3:1"], run_dir=f"{tmp}/pipe", **pipe))
        out["pipe"] = [i["node_id"] for i in sorted(r.worker_info, key=lambda i: i["rank"])]
        out["pipe_summary"] = {k: r.summary[k] for k in ("status", "failures", "steps_completed")}
        theta = lambda run_dir: torch.load(f"{run_dir}/checkpoints/final.pt", weights_only=True)["model"]
        whole = run_training(RunConfig(max_steps=6, run_dir=f"{tmp}/whole", **pipe))
        out["pipe_gap"] = max(
            (a - b).abs().max().item() for a, b in zip(theta(r.run_dir).values(), theta(whole.run_dir).values())
        )
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
    # Pipeline replicas spread, each replica's stages on one node (ranks 0-1: replica 0, 2-3: replica 1).
    pipe = out["pipe"]
    assert pipe[0] == pipe[1] and pipe[2] == pipe[3] and pipe[0] != pipe[2], pipe
    assert out["pipe_summary"] == {"status": "completed", "failures": 1, "steps_completed": 6}
    assert out["pipe_gap"] <= 1e-6
