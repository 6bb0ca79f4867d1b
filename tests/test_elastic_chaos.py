"""--chaos under --workers MIN..MAX (issue 18), one tiny run of BSP over the PS on the shared local Ray:
a kill-worker while the membership is above MIN is a leave (not a failure): the slot asks for a new
placement group and a worker joins it again; two kills at one step, the second of which would take the
run below MIN, restart it from its checkpoint (counted against --max-failures), as a fixed-size run's
loss does. Every (epoch, step, slice) unit still has exactly one row."""

from __future__ import annotations

import pandas as pd

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training


def test_kill_worker_above_min_is_a_leave_and_rejoin_and_below_min_restarts_from_the_checkpoint(
    tmp_path, ray_cluster
):
    chaos = ["kill-worker@6:2", "kill-worker@18:1", "kill-worker@18:2"]
    cfg = RunConfig(
        strategy="bsp", transport="ps", model="mlp", workers="2..3", batch_size=16, epochs=1, max_steps=26,
        segment_steps=2, checkpoint_steps=12, seed=3, chaos=chaos, hang_timeout_s=20.0, collective_timeout_s=60.0,
        run_dir=str(tmp_path / "r"),
    )
    s = run_training(cfg).summary
    assert s["status"] == "completed" and [c["fired_step"] for c in s["chaos"]] == [6, 18, 18]
    m = s["membership"]
    changes = [(e["change"], e["rank"], e["cause"]) for e in m["events"]]
    # At 6: rank 2 leaves (3 -> 2, still MIN) and its slot's new group is placed: it joins again.
    first = changes.index(("leave", 2, "worker lost"))
    assert ("join", 2, "placed") in changes[first + 1 :]
    # At 18: one of ranks 1 and 2 leaves (3 -> 2); the other's loss would go below MIN: the failure
    # path restarts every worker from the checkpoint at step 12.
    assert s["failures"] == 1, s["failure_events"]
    (failure,) = s["failure_events"]
    assert failure["target"] in (1, 2) and failure["restored_step"] == 12
    restart = [changes[i][1] for i, c in enumerate(changes) if c[2] == "restart"]
    assert len(restart) >= 2 and changes.index(("join", restart[0], "restart")) > first
    assert m["leaves"] == 2 and m["final_members"] >= 2
    rows = pd.read_parquet(tmp_path / "r" / "metrics.parquet").query("kind == 'step'")
    units = rows.groupby(["epoch", "step", "slice"]).size()
    assert len(units) == 26 * 3 and (units == 1).all()
