"""Elastic membership over the collective transport (`--workers MIN..MAX`, BSP) as the controller's
scaling policy (orchestrator/controller/collective_scaling.py), driven by the plain-Python worker group
of tests/unit/dummy_group.py: no Ray, no torch.distributed. The dummy runs each block in lock-step
rounds and a re-form gives every member the source's weight (its digest), so each test checks the
membership events, the recorded re-forms (who, from whom, the digests before and after) and the rows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from distrain.orchestrator.callbacks import Callback, Callbacks
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.controller.events import Progress
from distrain.orchestrator.controller.loop import PhaseLoop
from distrain.orchestrator.controller.status import Stage
from distrain.orchestrator.recovery import Failure
from tests.unit.dummy_group import DummyGroup
from tests.unit.test_controller import STEPS, config, controller, step_rows


def elastic_bsp(tmp_path: Path, workers: str, **options):
    # 4 rounds a block: a lost member's rounds before its death in the block stand, the rest are redone
    return config(tmp_path, workers=workers, segment_steps=4, **options)


def run(cfg, group: DummyGroup):
    ctl, events = controller(cfg, group)
    assert ctl.state.membership is not None
    ctl.state.membership.drain_poll_s = 0  # the dummy cluster is asked at every boundary
    return ctl, ctl.run().summary, events


def changes(summary: dict) -> list[tuple[str, int, str]]:
    return [(e["change"], e["rank"], e["cause"]) for e in summary["membership"]["events"]]


def all_units(cfg) -> Counter:
    return Counter({(s, r): 1 for s in range(STEPS) for r in range(cfg.worker_slots)})


def agreed(reform: dict) -> bool:
    """Every member of a re-formed group holds the source's parameters after it."""
    return set(reform["after"]) == {str(r) for r in reform["members"]} and set(reform["after"].values()) == {
        reform["before"][str(reform["source"])]
    }


def test_a_joiner_is_built_outside_the_group_and_joins_at_a_block_boundary_by_a_re_form(tmp_path):
    cfg = elastic_bsp(tmp_path, "2..3")
    group = DummyGroup(cfg, placed={0: 0, 1: 0, 2: 4})  # slot 2 has room once 4 steps are done
    ctl, s, _ = run(cfg, group)
    assert s["status"] == "completed" and s["failures"] == 0
    assert changes(s) == [("join", 0, "start"), ("join", 1, "start"), ("join", 2, "placed")]
    join = s["membership"]["events"][2]
    assert join["step"] >= 4 and join["members"] == 3 and "setup_s" in join  # the re-form's seconds
    start, grow = s["membership"]["reforms"]
    assert (start["cause"], start["members"], start["survivors"]) == ("start", [0, 1], [])
    assert (grow["cause"], grow["members"], grow["survivors"], grow["source"]) == ("resize", [0, 1, 2], [0, 1], 0)
    assert grow["before"]["2"] == "0" != grow["before"]["0"]  # the joiner had trained nothing ...
    assert agreed(start) and agreed(grow)  # ... and took the members' state: nothing from disk
    # Built (its start-up waited on) before it was admitted, and admitted before the group re-formed for it.
    i = group.log.index(("start_joiner", 2))
    assert group.log.index(("admit", 2)) > i and group.log.index(("reform", (2, 0))) > group.log.index(("admit", 2))
    assert group.units_by_rank[2] > 0 and step_rows(cfg) == all_units(cfg)
    assert Stage.RESIZING in ctl.machine.history and Stage.RECOVERING not in ctl.machine.history


def test_a_draining_node_gets_a_checkpoint_at_the_step_boundary_then_its_members_leave(tmp_path):
    cfg = elastic_bsp(tmp_path, "1..3", checkpoint_steps=0)  # no periodic checkpoint: the drain's is the only one
    # Two members of 3 slots: a block of 4 rounds is 8 units, so the drain (seen once 2 steps are done) is
    # first seen mid-step, and the next block ends at the step boundary where the checkpoint is taken.
    group = DummyGroup(cfg, placed={0: 0, 1: 0}, drain={1: 2})
    _, s, _ = run(cfg, group)
    assert s["status"] == "completed" and s["failures"] == 0
    m = s["membership"]
    assert changes(s)[2:] == [("leave", 1, "node draining")]
    (drain,) = m["drain_checkpoints"]
    leave = m["events"][2]
    assert drain["node"] == "node-1" and drain["ranks"] == [1] and drain["step"] == leave["step"] >= 2
    assert drain["path"] is not None and Path(drain["path"]).name == f"step-{drain['step']:08d}.pt"
    assert load_checkpoint(Path(drain["path"]))["global_step"] == drain["step"]  # written before it left
    assert ("kill", 1) in group.log and ("renew", 1) in group.log  # its slot asks for room again
    assert leave["units_redone"] == 0 and leave["units_without_row"] == []  # left between blocks: nothing lost
    shrink = m["reforms"][-1]
    assert (shrink["members"], shrink["source"], shrink["step"]) == ([0], 0, drain["step"]) and agreed(shrink)
    assert shrink["units_done"] == drain["step"] * cfg.worker_slots  # at a step boundary: nothing of the next
    assert step_rows(cfg) == all_units(cfg)


def test_a_member_lost_above_min_leaves_and_the_survivors_re_form_from_one_of_them(tmp_path):
    cfg = elastic_bsp(tmp_path, "1..3")
    group = DummyGroup(cfg, placed={0: 0, 1: 0, 2: 0}, die={1: 6})  # 1 dies at its unit of step 6, mid-block
    ctl, s, events = run(cfg, group)
    assert s["status"] == "completed" and s["failures"] == 0 and not events_of(events, Failure)  # a shrink
    m = s["membership"]
    assert changes(s)[3:] == [("leave", 1, "worker lost")]
    leave = m["events"][3]
    assert leave["members"] == 2 and leave["detail"] == "ActorDiedError" and leave["units_redone"] > 0
    assert m["samples_redone"] == leave["units_redone"] * cfg.batch_size
    shrink = m["reforms"][-1]
    assert (shrink["cause"], shrink["members"], shrink["survivors"]) == ("resize", [0, 2], [0, 2])
    assert shrink["source"] in (0, 2) and agreed(shrink)  # from a survivor, in memory
    # Its units in rounds that stood were applied but their rows died with it: listed, never invented;
    # every other unit (the abandoned rounds' redone by the survivors) has exactly one row.
    without_row = {tuple(u[1:]) for u in leave["units_without_row"]}
    assert without_row and all(slice_ == 1 for _, slice_ in without_row)
    assert step_rows(cfg) == all_units(cfg) - Counter(without_row)
    assert ("renew", 1) in group.log and group.restarts == 0
    assert Stage.RECOVERING not in ctl.machine.history


def test_a_member_lost_below_min_ends_the_attempt_and_the_run_restarts_from_its_checkpoint(tmp_path):
    cfg = elastic_bsp(tmp_path, "2..3")
    group = DummyGroup(cfg, placed={0: 0, 1: 0}, die={1: 6}, room_again=True)
    ctl, s, events = run(cfg, group)
    assert s["status"] == "completed" and s["failures"] == 1
    (failure,) = s["failure_events"]
    assert (failure["action"], failure["kind"], failure["target"]) == ("restarted", "worker", 1)
    assert failure["restored_step"] == 4 and group.restarts == 1
    assert [e.then for e in events_of(events, Failure)] == ["restarting from the checkpoint at step 4"]
    assert changes(s)[2:] == [("leave", 1, "worker lost"), ("join", 0, "restart"), ("join", 1, "restart")]
    reforms = s["membership"]["reforms"]
    assert [r["cause"] for r in reforms] == ["start", "start"]  # no shrink: a new attempt's group instead
    assert reforms[1]["step"] == 4 and agreed(reforms[1])
    assert step_rows(cfg) == all_units(cfg)  # the rows after the restore point dropped, then redone
    i = ctl.machine.history.index(Stage.RECOVERING)
    assert ctl.machine.history[i + 1] == Stage.STARTING and ctl.machine.history[-1] == Stage.COMPLETED


def test_a_chaos_kill_is_found_by_the_next_block_and_the_member_leaves(tmp_path):
    cfg = elastic_bsp(tmp_path, "1..3", chaos="kill-worker@6:2")
    group = DummyGroup(cfg, placed={0: 0, 1: 0, 2: 0})
    _, s, _ = run(cfg, group)
    (record,) = s["chaos"]
    assert record["fired"] and record["fired_step"] == 6 and record["target"] == 2
    assert s["status"] == "completed" and s["failures"] == 0
    leave = s["membership"]["events"][3]
    assert (leave["change"], leave["rank"], leave["step"]) == ("leave", 2, 6)
    assert leave["units_without_row"] == []  # it died before the block's first round: nothing stood
    assert s["membership"]["reforms"][-1]["members"] == [0, 1]
    assert step_rows(cfg) == all_units(cfg)


def events_of(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


class StopAt(Callback):
    """Asks the run to stop once a row of step `step` or later is in."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_rows(self, rows: dict) -> bool:
        return max(rows["step"]) >= self.step


def test_the_one_loop_runs_the_blocks_their_losses_a_chaos_hold_and_a_callback_stop(tmp_path, monkeypatch):
    """Lock-step blocks are a work source of the same `PhaseLoop` as every other plan: the --chaos hold's
    strike, the failure policy's decision on a member lost in a block and a callback's stop go through
    that loop's own code."""
    seen: dict[str, list] = {"loops": [], "lost": [], "strikes": []}
    lose, go_on = PhaseLoop.lose, PhaseLoop.go_on

    def spy_lose(self, lost, rank=None):
        seen["lost"].append((lost.target, bool(self.dispatch.block)))
        return lose(self, lost, rank)

    def spy_go_on(self, rank):
        seen["loops"].append(type(self.dispatch).__name__)
        if self.dispatch.reached_hold():
            seen["strikes"].append(self.a.steps_done)
        return go_on(self, rank)

    monkeypatch.setattr(PhaseLoop, "lose", spy_lose)
    monkeypatch.setattr(PhaseLoop, "go_on", spy_go_on)
    cfg = elastic_bsp(tmp_path, "1..3", chaos="kill-worker@6:2", max_steps=0, epochs=2)
    group = DummyGroup(cfg, placed={0: 0, 1: 0, 2: 0})
    ctl, events = controller(cfg, group)
    ctl.hooks = Callbacks([StopAt(9)])
    ctl.state.membership.drain_poll_s = 0
    s = ctl.run().summary
    assert set(seen["loops"]) == {"BlockDispatcher"}
    assert seen["strikes"] == [6] and s["chaos"][0]["fired_step"] == 6  # struck by the loop at the hold
    # The killed member is found by the next block; the loop's `lose` sets it aside until the block is
    # whole, then decides on it (a leave: the run keeps MIN).
    assert seen["lost"] == [(2, True), (2, False)]
    assert changes(s)[3:] == [("leave", 2, "worker lost")] and s["failures"] == 0
    # Stopped by the callback inside the first epoch: the step dealt last is finished, every
    # unit before it has its one row, and the epoch cut short is evaluated at that step.
    done = ctl.state.steps_done
    assert s["status"] == "stopped" and 9 < done < group.spe
    units = Counter({(step, r): 1 for step in range(done) for r in range(cfg.worker_slots)})
    assert step_rows(cfg) == units
    assert [(e.epoch, e.steps_done) for e in events_of(events, Progress) if e.evaluated] == [(0, done)]
