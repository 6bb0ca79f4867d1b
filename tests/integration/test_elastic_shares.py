"""--balance speed under --workers MIN..MAX (BSP over the collective transport, issue 31) on a simulated
multi-node cluster (ray.cluster_utils.Cluster, in a subprocess: one Ray per process). One run,
`--workers 2..3 --balance speed`: the head has room for MIN; a node added mid-run brings rank 2 in, at
the mean share of the members (B / 3 of the global batch B = 48, the others keeping their ratio in the
rest); that node then crashes and rank 2 leaves, its share going to the others. (--straggler does not
compose with a range, so the members are equal here: that a joiner comes in at the mean of unequal
shares is the unit tests'.) Checked from the
recorded step rows (`samples`, `slice`): every step of every epoch is cut among that step's members into
blocks covering its B samples, each (epoch, sample) exactly once; the run completes. The share arithmetic
and the step rounds without Ray: tests/unit/test_elastic_shares.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.orchestrator.tasks import build_task
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.splits import task_splits

pytestmark = pytest.mark.integration
B = 48  # MAX 3 x --batch-size 16
ARGS = dict(strategy="bsp", model="mlp", workers="2..3", batch_size=16, epochs=5, segment_steps=4, seed=3)

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from tests.integration.simulated_cluster import crash, start
    from distrain.config import RunConfig
    from distrain.orchestrator.callbacks import Callback
    from distrain.orchestrator.run import run_training

    cluster = start(2)
    log, nodes = [], {}


    class Churn(Callback):
        # In the driver's thread, between blocks (on_rows: one call per member's rows of a block).
        def __init__(self):
            self.phase, self.steps, self.after = "balance", 0, 0

        def on_rows(self, rows):
            self.steps += len(rows["step"])
            workers = rows["worker"]
            if self.phase == "balance" and self.steps >= 16:  # a few blocks at MIN first
                nodes["a"] = cluster.add_node(num_cpus=1)  # rank 2's slot is placed there
                log.append(("added a", time.time()))
                self.phase = "grown"
            elif self.phase == "grown" and 2 in workers:
                crash(cluster, nodes["a"])  # between blocks: the next one's all-reduce fails on the closed peer
                log.append(("crashed a", time.time()))
                self.phase = "crashed"
            elif self.phase == "crashed":
                self.after += 1  # the next block (dealt to all three) fails, rank 2 leaves, the two go on
                if self.after >= 6:
                    self.phase = "done"
            if self.phase in ("grown", "crashed"):
                # the members run through their blocks faster than a node starts on a loaded machine (seconds):
                # keep the run going until the joiner is in, and until the group has shrunk again
                time.sleep(0.7)



    churn = Churn()
    cfg = RunConfig(**json.loads(sys.argv[2]), balance="speed", hang_timeout_s=30.0,
                    collective_timeout_s=30.0, run_dir=sys.argv[1])
    r = run_training(cfg, callbacks=[churn])
    out = {"summary": r.summary, "phase": churn.phase, "log": log}
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out, default=str))
    """
)


@pytest.mark.serial  # beside another test file's runs, a run could end before its new node's worker joined
def test_a_joiner_starts_at_the_mean_share_and_every_sample_is_seen_once_through_a_join_and_a_leave(tmp_path):
    run_dir = tmp_path / "r"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(run_dir), json.dumps(ARGS)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    s, m = out["summary"], out["summary"]["membership"]
    assert out["phase"] == "done", out["log"]
    assert s["status"] == "completed" and s["failures"] == 0, s["failure_events"]  # a shrink above MIN
    joins = [e for e in m["events"] if e["change"] == "join" and e["cause"] == "placed"]
    leaves = [e for e in m["events"] if e["change"] == "leave"]
    assert [e["rank"] for e in joins] == [2] and [e["rank"] for e in leaves] == [2]
    assert m["peak_members"] == 3 and m["final_members"] == 2

    rows = pd.read_parquet(run_dir / "metrics.parquet").query("kind == 'step'")
    # The joiner's first share is the mean share of the members it joined: B / 3, whatever the others had,
    # and the others keep their ratio in the rest (to a sample).
    first = rows[rows["worker"] == 2].sort_values("step").iloc[0]
    assert first["samples"] == B // 3, first
    at_join = rows[rows["step"] == first["step"]].set_index("worker")["samples"]
    before = rows[rows["step"] == first["step"] - 1].set_index("worker")["samples"]
    assert at_join.sum() == B and len(at_join) == 3 and sorted(before.index) == [0, 1]
    assert abs(at_join[0] - (B - B // 3) * before[0] / B) <= 1, (before, at_join)
    join_move = next(mv for mv in s["balance"]["moves"] if mv.get("joined") == [2])
    assert join_move["shares"][2] == B // 3 and sum(join_move["shares"]) == B

    # Every (epoch, sample) exactly once: each step's rows (and the lost member's units in rounds that stood,
    # whose rows died with it: listed in its leave event, the rest of the step theirs) cut the step's B.
    config = RunConfig(**ARGS)
    sharder = EpochSharder(len(task_splits(build_task(config), config.val_fraction).train), B, config.seed)
    spe = sharder.steps_per_epoch
    assert s["steps_completed"] == 5 * spe
    without_row = {(u[0], u[1]): u[2] for e in leaves for u in e["units_without_row"]}
    seen = []
    for (epoch, step), rows_of in rows.groupby(["epoch", "step"]):
        within = step - epoch * spe
        shares = dict(zip(rows_of["slice"], rows_of["samples"], strict=True))
        assert len(shares) == len(rows_of)  # one row per member's slot
        if (epoch, within) in without_row:
            shares[without_row[epoch, within]] = B - sum(shares.values())
        cut = tuple(int(shares.get(slot, 0)) for slot in range(3))
        assert sum(cut) == B, (epoch, step, cut)
        blocks = np.concatenate([sharder.worker_indices(epoch, within, r, 3, cut) for r in range(3)])
        assert np.array_equal(blocks, sharder.global_batch_indices(epoch, within))
        seen += [(epoch, int(i)) for i in blocks]
    assert len(seen) == len(set(seen)) == 5 * spe * B
    assert s["final_test_accuracy"] > 0.5
