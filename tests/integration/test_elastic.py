"""Elastic membership (issue 18) on a simulated multi-node cluster (ray.cluster_utils.Cluster, in a
subprocess: one Ray per process). One SSP run over the parameter server (its bound then holds among
the members), `--workers 1..3`, sees
everything in turn: the head has room for MIN; a node added mid-run grows it to MAX; that node is
drained for preemption (a checkpoint is written, its workers move off); a second node brings the run
back to MAX; that node is then removed without warning and the run shrinks again. Checked from the
recorded metrics: every sample of each epoch exactly once, versions and clocks only moving forward,
joiners starting from the live shards' parameters.

Only SSP churns here (async did too, until issue 27 cut CI time): async is the same strategy base
(strategies/ps.py `OnArrival`: the same shards, units and membership code) with an infinite bound,
i.e. SSP's path minus the waits that `ParameterShard.set_members` must release; the second run cost
CI over a minute and checked no line SSP's does not reach."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import pandas as pd
    import ray
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2
    from distrain.config import RunConfig
    from distrain.orchestrator.callbacks import Callback
    from distrain.orchestrator.run import run_training

    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": fast})
    ray.init(address=cluster.address)
    head = ray.get_runtime_context().get_node_id()
    gcs = ray._raylet.GcsClient(address=cluster.address)
    PREEMPTION = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    log, nodes = [], {}


    class Churn(Callback):
        # In the driver's thread (add_node needs the main thread), between results: each change waits
        # for the one before it to show in the rows.
        def __init__(self):
            self.phase, self.seen, self.rows_since = "grow", set(), 0

        def on_checkpoint(self, path, step):
            log.append(("checkpoint", str(path), time.time()))
            if self.phase == "draining":  # the drain's checkpoint: its workers leave right after it
                self.phase, self.rows_since = "drained", 0

        def on_rows(self, rows):
            self.seen |= set(rows["worker"])
            self.rows_since += len(rows["worker"])
            if self.phase == "drained" and set(rows["worker"]) & {1, 2}:
                self.rows_since = 0  # the drained node's workers still train: wait until they have left
            both = {1, 2} <= self.seen
            if self.phase == "grow":
                nodes["a"] = cluster.add_node(num_cpus=2)
                self.phase, self.seen = "grown", set()
            elif self.phase == "grown" and both:
                deadline = int(time.time() * 1000) + 60_000
                ok, why = gcs.drain_node(nodes["a"].node_id, PREEMPTION, "spot node reclaimed", deadline)
                log.append(("drain", ok, why, time.time()))
                self.phase, self.rows_since = "draining", 0
            elif self.phase == "drained" and self.rows_since >= 6:  # 6 rows and none from 1 or 2: they left
                nodes["b"] = cluster.add_node(num_cpus=2)
                cluster.remove_node(nodes["a"])  # nothing kills a drained node at its deadline: we do
                log.append(("removed a", time.time()))
                self.phase, self.seen = "regrow", set()
            elif self.phase == "regrow" and both:
                cluster.remove_node(nodes["b"], allow_graceful=False)
                log.append(("removed b", time.time()))
                self.phase = "done"


    churn = Churn()
    cfg = RunConfig(
        strategy=sys.argv[2], model="mlp", workers="1..3", batch_size=16, epochs=4, segment_steps=2, seed=3,
        comm_delay_ms=120.0, hang_timeout_s=30.0, collective_timeout_s=60.0, run_dir=sys.argv[1],
    )
    r = run_training(cfg, callbacks=[churn])
    df = pd.read_parquet(r.run_dir / "metrics.parquet")
    out = {
        "summary": r.summary, "phase": churn.phase, "log": log,
        "nodes": {k: n.node_id for k, n in nodes.items()}, "head": head,
        "final_nodes": [i["node_id"] for i in r.worker_info],
    }
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out, default=str))
    """
)


def test_workers_join_leave_and_move_off_a_draining_node_with_every_sample_once(tmp_path):
    run_dir = tmp_path / "r"
    args = [sys.executable, "-c", SCRIPT, str(run_dir), "ssp"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    s, m = out["summary"], out["summary"]["membership"]
    assert out["phase"] == "done", out["log"]  # every change happened while the run went on
    assert s["status"] == "completed" and s["failures"] == 0, s["failure_events"]  # leaves above MIN are not
    assert s["workers"] == "1..3" and m["min"] == 1 and m["max"] == 3 and m["peak_members"] == 3
    events = m["events"]
    changes = [(e["change"], e["rank"], e["cause"]) for e in events]
    assert changes[0] == ("join", 0, "start")
    # grown to MAX, moved off the drained node, back to MAX, shrunk when the second node went
    joins = [e for e in events if e["change"] == "join" and e["cause"] == "placed"]
    drained = [e for e in events if e["cause"] == "node draining"]
    lost = [e for e in events if e["change"] == "leave" and e["cause"] != "node draining"]
    assert sorted(e["rank"] for e in joins) == [1, 1, 2, 2] and sorted(e["rank"] for e in drained) == [1, 2]
    assert sorted(e["rank"] for e in lost) == [1, 2] and all(e["cause"] in ("node lost", "worker lost") for e in lost)
    assert max(e["members"] for e in events) == 3 and events[-1]["members"] == 1 and m["final_members"] == 1
    # Preemption: a checkpoint was written before the drained node's workers left, from the live run.
    (ckpt,) = m["drain_checkpoints"]
    assert ckpt["node"] == out["nodes"]["a"] and sorted(ckpt["ranks"]) == [1, 2]
    assert ckpt["wall_time"] <= min(e["wall_time"] for e in drained) and (run_dir / "checkpoints").is_dir()
    assert any(entry[0] == "checkpoint" and entry[1] == ckpt["path"] for entry in out["log"])
    assert out["final_nodes"] == [out["head"]]

    rows = pd.read_parquet(run_dir / "metrics.parquet").query("kind == 'step'")
    spe = s["steps_completed"] // 4
    # Every sample of every epoch exactly once: each (epoch, step, slice) unit of B samples has one row.
    units = rows.groupby(["epoch", "step", "slice"]).size()
    assert len(units) == s["steps_completed"] * 3 and (units == 1).all()
    assert rows.groupby("epoch")["samples"].sum().tolist() == [spe * 3 * 16] * 4
    assert m["samples_redone"] == 16 * sum(e["units_redone"] for e in events) and m["samples_redone"] > 0
    # Versions only move forward: each update applied once, in each worker's order; clocks never go back.
    assert rows["applied_version"].is_unique
    for _, own in rows.sort_values("wall_time").groupby("worker"):
        assert own["applied_version"].is_monotonic_increasing and own["clock"].is_monotonic_increasing
    # A joiner starts from the shards' current parameters (never from disk, never from the start).
    for join in joins:
        before = rows[rows["wall_time"] <= join["wall_time"]]["applied_version"].max()
        after = rows[(rows["worker"] == join["rank"]) & (rows["wall_time"] > join["wall_time"])]
        assert after["read_version"].iloc[0] >= before > 0
    assert set(rows["worker"]) == {0, 1, 2} and s["final_test_accuracy"] > 0.5
