"""Resource groups on a simulated two-node Ray cluster (ray.cluster_utils.Cluster): one node with the
custom resource "fast", one with "slow"; `--worker-group fast:1:48:fast=1 --worker-group slow:1:16:slow=1`
puts each group's worker on its kind of node, each takes its group's batch, every sample of the epoch is
seen once, and the run is the `--worker-weights 3,1` run (the same shares: the same update).

The cluster runs in a subprocess: a test process can hold only one Ray connection, and the other tests
share the session's single-node Ray. The `--worker-weights` reference needs no particular node: it runs
here, on the session's Ray, while the subprocess starts its cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from distrain.orchestrator.tasks import build_task
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.splits import task_splits
from tests.helpers import final_params

pytestmark = pytest.mark.integration  # a two-node Ray in a subprocess: tens of seconds

GROUPS = ["fast:1:48:fast=1", "slow:1:16:slow=1"]
BASE = dict(
    model="mlp", epochs=1, seed=3, optimizer="sgd", momentum=0.9, lr=0.05, lr_scaling="none", segment_steps=4,
    eval_every=0, val_fraction=0.0,
)  # fmt: skip

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import ray
    from ray.cluster_utils import Cluster
    from distrain.config import RunConfig
    from distrain.orchestrator.run import run_training

    base, groups = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    head = {"num_cpus": 2, "resources": {"fast": 1}, "include_dashboard": False}  # (no dashboard: not used)
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=2, resources={"slow": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    kinds = {k: n["NodeID"] for n in ray.nodes() if n["Alive"] for k in ("fast", "slow") if k in n["Resources"]}
    r = run_training(RunConfig(worker_groups=groups, run_dir="groups", **base))
    out = {"kinds": kinds, "nodes": [i["node_id"] for i in sorted(r.worker_info, key=lambda i: i["rank"])]}
    out["summary"] = {k: r.summary[k] for k in ("status", "global_batch_size", "worker_shares", "steps_completed")}
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


def test_groups_go_to_their_kind_of_node_take_their_batches_and_equal_static_shares(tmp_path, ray_cluster):
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, json.dumps(BASE), json.dumps(GROUPS)], stdout=out, stderr=err, cwd=tmp_path
        )
        try:  # the reference meanwhile, here
            weights = dict(workers=2, batch_size=32, worker_weights="3,1", run_dir=str(tmp_path / "weights"))
            run_training(RunConfig(**weights, **BASE))
        finally:
            try:
                proc.wait(timeout=600)
            finally:
                proc.kill()  # (ended already, unless it ran out of time)
    assert proc.returncode == 0, stderr.read_text()[-3000:]
    line = next(line for line in stdout.read_text().splitlines() if line.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    # Placement: rank 0 (group fast) on the node with "fast", rank 1 (group slow) on the one with "slow",
    # although --placement pack would otherwise put both on one node.
    assert out["nodes"] == [out["kinds"]["fast"], out["kinds"]["slow"]] and len(set(out["nodes"])) == 2
    assert out["summary"]["status"] == "completed"
    assert out["summary"]["global_batch_size"] == 64 and out["summary"]["worker_shares"] == [48, 16]

    # Each worker's recorded samples are its group's batch, and each step's blocks cover the step's 64
    # samples: every sample of the epoch exactly once.
    df = pd.read_parquet(tmp_path / "groups" / "metrics.parquet")
    steps = df[df["kind"] == "step"].sort_values(["step", "worker"])
    assert steps.groupby("worker")["samples"].unique().map(list).to_dict() == {0: [48], 1: [16]}
    config = RunConfig(worker_groups=GROUPS, **BASE)
    sharder = EpochSharder(len(task_splits(build_task(config), config.val_fraction).train), 64, config.seed)
    assert out["summary"]["steps_completed"] == sharder.steps_per_epoch == steps["step"].nunique()
    seen = []
    for step in sorted(steps["step"].unique()):
        blocks = [sharder.worker_indices(0, int(step), r, 2, (48, 16)) for r in range(2)]
        assert np.array_equal(np.concatenate(blocks), sharder.global_batch_indices(0, int(step)))
        seen += [int(i) for b in blocks for i in b]
    assert len(seen) == len(set(seen)) == sharder.steps_per_epoch * 64

    # The same shares as --worker-weights 3,1 at B = 64: the same update, step by step and at the end.
    weights = pd.read_parquet(tmp_path / "weights" / "metrics.parquet")
    weights = weights[weights["kind"] == "step"].sort_values(["step", "worker"])
    assert np.allclose(steps["loss"].to_numpy(), weights["loss"].to_numpy(), atol=1e-5)
    gap = (final_params(tmp_path / "groups") - final_params(tmp_path / "weights")).abs().max().item()
    assert gap <= 1e-5, gap
