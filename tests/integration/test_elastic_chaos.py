"""--chaos under --workers MIN..MAX (issue 18), one tiny run of BSP over the PS on the shared local Ray:
a kill-worker while the membership is above MIN is a leave (not a failure): the slot asks for a new
placement group and a worker joins it again; two kills at one step, the second of which would take the
run below MIN, restart it from its checkpoint (counted against --max-failures), as a fixed-size run's
loss does. Every (epoch, step, slice) unit still has exactly one row."""

from __future__ import annotations

import time

import pandas as pd

from distrain.config import RunConfig
from distrain.orchestrator.callbacks import Callback
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
    # path restarts every worker from the checkpoint at step 12. Unless the first one's slot was placed
    # and joined again before the second death was seen (a loaded machine: seen at its next call), when
    # the membership was back at 3 and the second loss is a leave too; both are the rule.
    rejoined = changes.index(("join", 2, "placed"), first)
    at_18 = [i for i, c in enumerate(changes) if i > rejoined and c[0] == "leave"]
    if s["failures"] == 0:
        assert len(at_18) == 2 and m["leaves"] == 3, changes
        assert any(c[0] == "join" and c[2] == "placed" for c in changes[at_18[0] + 1 : at_18[1]]), changes
    else:
        assert s["failures"] == 1, s["failure_events"]
        (failure,) = s["failure_events"]
        assert failure["target"] in (1, 2) and failure["restored_step"] == 12
        restart = [changes[i][1] for i, c in enumerate(changes) if c[2] == "restart"]
        assert len(restart) >= 2 and changes.index(("join", restart[0], "restart")) > first
        assert m["leaves"] == 2
    assert m["final_members"] >= 2
    rows = pd.read_parquet(tmp_path / "r" / "metrics.parquet").query("kind == 'step'")
    units = rows.groupby(["epoch", "step", "slice"]).size()
    assert len(units) == 26 * 3 and (units == 1).all()


class _PaceUntilRankTwoTrains(Callback):
    """Blocks run faster than a joiner is built: until rank 2 has trained before the first kill (at
    step 10) and again after it (it rejoined), slow the driver between blocks, so the --chaos events
    find it a member and the test is deterministic."""

    def __init__(self) -> None:
        self.latest, self.before, self.after = 0, False, False

    def on_rows(self, rows):
        self.latest = max([self.latest, *rows["step"]])
        mine = [step for worker, step in zip(rows["worker"], rows["step"], strict=True) if worker == 2]
        self.before = self.before or any(step < 10 for step in mine)
        self.after = self.after or any(step >= 10 for step in mine)
        if not self.before or (self.latest >= 10 and not self.after):
            time.sleep(0.5)


def test_collective_kill_worker_above_min_is_a_leave_and_rejoin_below_min_a_restart(tmp_path, ray_cluster):
    """The same under BSP over the collective (orchestrator/controller/collective_scaling.py): the fault is
    injected at a block boundary, the next block's all-reduce fails on the killed peer, the survivors
    re-form without it and redo the block; a later kill of two of three at once restarts from the
    checkpoint. Every unit has exactly one row (kills land between blocks, so no applied unit loses
    its row)."""
    chaos = ["kill-worker@10:2", "kill-worker@20:1", "kill-worker@20:2"]
    cfg = RunConfig(
        strategy="bsp", model="mlp", workers="2..3", batch_size=16, epochs=1, max_steps=26, segment_steps=2,
        checkpoint_steps=8, seed=3, chaos=chaos, hang_timeout_s=20.0, collective_timeout_s=30.0,
        run_dir=str(tmp_path / "r"),
    )  # fmt: skip
    s = run_training(cfg, callbacks=[_PaceUntilRankTwoTrains()]).summary
    assert s["status"] == "completed" and [c["fired_step"] for c in s["chaos"]] == [10, 20, 20], s["chaos"]
    m = s["membership"]
    changes = [(e["change"], e["rank"], e["cause"]) for e in m["events"]]
    first = changes.index(("leave", 2, "worker lost"))
    assert ("join", 2, "placed") in changes[first + 1 :] and m["samples_redone"] > 0
    assert s["failures"] == 1, s["failure_events"]
    (failure,) = s["failure_events"]
    assert failure["target"] in (1, 2) and failure["restored_step"] == 16
    for reform in m["reforms"]:  # every re-form leaves the members with one model
        assert len(set(reform["after"].values())) == 1, reform
    rows = pd.read_parquet(tmp_path / "r" / "metrics.parquet").query("kind == 'step'")
    units = rows.groupby(["epoch", "step", "slice"]).size()
    assert len(units) == 26 * 3 and (units == 1).all()
