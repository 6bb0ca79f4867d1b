"""The controller (orchestrator/controller/) driven through failures, restarts, joins, leaves, chaos
events, an interrupt and a resume by the plain-Python worker group of tests/unit/dummy_group.py: no
Ray, no torch.distributed. Each test checks what the run ends with (status, the failure ledger, the
stages it went through), which steps were trained (and re-trained), and what the group was asked."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from distrain.config import RunConfig
from distrain.errors import RunFailed
from distrain.orchestrator.checkpoint import latest_checkpoint, load_checkpoint
from distrain.orchestrator.controller.controller import Controller
from distrain.orchestrator.controller.run_state import Plan, RunState
from distrain.orchestrator.controller.status import Stage
from distrain.orchestrator.membership import Membership
from distrain.orchestrator.recovery import Failure
from distrain.orchestrator.resume import recorded_rows
from tests.unit.dummy_group import DummyGroup

STEPS = 12  # every run here: 12 global steps (--max-steps), one epoch
RunConfig()  # the first config built checks its optimizer with torch.optim, which imports for seconds: here, once


def config(tmp_path: Path, **options) -> RunConfig:
    options = {"strategy": "bsp", "workers": 2, "max_steps": STEPS, "checkpoint_steps": 4} | options
    return RunConfig(run_dir=str(tmp_path / "run"), **options)


def controller(cfg: RunConfig, group: DummyGroup, plan: Plan | None = None) -> tuple[Controller, list]:
    plan = plan or Plan(Path(cfg.run_dir), 1, None)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    state = RunState.create(cfg, plan)
    if cfg.elastic:  # the dummy answers the elastic placement's questions too
        state.membership = Membership(cfg, group)  # type: ignore[arg-type]
    events: list = []
    return Controller(cfg, plan, state, group, events.append, None, group.placed_ranks), events


def step_rows(cfg: RunConfig) -> Counter:
    """(step, slice) -> metrics rows of it in the run's metrics.parquet."""
    table = pq.read_table(Path(cfg.run_dir) / "metrics.parquet").to_pydict()
    rows = zip(table["kind"], table["step"], table["slice"], strict=True)
    return Counter((step, slice_) for kind, step, slice_ in rows if kind == "step")


def summary(cfg: RunConfig) -> dict:
    return json.loads((Path(cfg.run_dir) / "summary.json").read_text())


def final_weight(cfg: RunConfig) -> float:
    """The final checkpoint's model: the dummy's weight counts the steps its worker applied."""
    return float(load_checkpoint(Path(cfg.run_dir) / "checkpoints" / "final.pt")["model"]["w"])


def every_unit_once(cfg: RunConfig) -> bool:
    return step_rows(cfg) == Counter({(s, r): 1 for s in range(STEPS) for r in range(cfg.worker_slots)})


def test_a_collective_worker_death_restarts_every_worker_from_the_restore_point(tmp_path):
    cfg = config(tmp_path)
    group = DummyGroup(cfg, die={1: 6})
    ctl, events = controller(cfg, group)
    result = ctl.run()
    s = result.summary
    assert s["status"] == "completed" and s["failures"] == 1 and s["replacements"] == 0
    (failure,) = s["failure_events"]
    assert (failure["action"], failure["kind"], failure["target"]) == ("restarted", "worker", 1)
    assert failure["restored_step"] == 4 and failure["updates_lost"] == failure["at_step"] - 4
    assert ("load_state", 4.0) in group.log and group.restarts == 1  # the checkpoint at step 4, a new placement
    # Steps 4.. ran again (worker 1 died before its unit of step 6), the steps before them once.
    assert all(group.trained[(step, r)] == 1 for step in range(4) for r in (0, 1))
    assert group.trained[(4, 1)] == 2 and group.trained[(6, 1)] == 1 and group.trained[(6, 0)] == 2
    assert every_unit_once(cfg)  # the rows after the restore point were dropped, then redone
    assert final_weight(cfg) == STEPS  # 4 restored + 8 trained: the run that never failed
    i = ctl.machine.history.index(Stage.RECOVERING)
    assert ctl.machine.history[i + 1] == Stage.STARTING and ctl.machine.history[-1] == Stage.COMPLETED
    assert [e.then for e in events if isinstance(e, Failure)] == ["restarting from the checkpoint at step 4"]


@pytest.mark.parametrize("transport", ["collective", "ps"])
def test_a_restart_gives_each_rank_its_own_codec_state_of_the_restore_point(tmp_path, transport):
    """Under a codec each rank's residuals go into every checkpoint (step 4, 8, the final) and a restart
    loads each rank its own (orchestrator/channel_checkpoint.py); the dummy's residual is (rank, step it
    was taken at). Under the PS the dummy's rank 0 runs to step 8 before rank 1's first segment is back:
    the step-4 checkpoint waits for rank 1's residuals instead of being written without them."""
    cfg = config(tmp_path, compress="topk:0.05", transport=transport)
    if transport == "ps":  # a worker would be replaced (its residuals start at zero); a shard's loss restarts
        group, restored = DummyGroup(cfg, shard_dies_at=10), 8
    else:
        group, restored = DummyGroup(cfg, die={1: 6}), 4
    ctl, events = controller(cfg, group)
    assert ctl.run().summary["status"] == "completed" and group.restarts == 1
    assert ("load_state", float(restored)) in group.log
    assert ("load_channel", {0: [0, restored], 1: [1, restored]}) in group.log  # each rank its own
    for name, step in (("step-00000004.pt", 4), ("step-00000008.pt", 8), ("final.pt", STEPS)):
        saved = load_checkpoint(Path(cfg.run_dir) / "checkpoints" / name)
        assert saved["version"] == 2 and saved["channel"]["codec"] == "topk:0.05"
        assert {r: s["grads"]["residual"].tolist() for r, s in saved["channel"]["ranks"].items()} == {
            0: [0, step], 1: [1, step]
        }
    assert not [e for e in events if "error-feedback" in getattr(e, "text", "")]  # restored: nothing said


def test_a_callback_stop_s_final_checkpoint_holds_every_rank_s_codec_state_at_the_stop(tmp_path):
    """A callback's stop moves the run's end after the segments ending there were sent, so no worker
    shipped its codec state with them: the final checkpoint asks each member for its state once every
    call is done (the state at the stop's step: nobody trains any more) instead of going without."""
    from distrain.orchestrator.callbacks import Callback, Callbacks

    class StopEarly(Callback):
        def on_rows(self, rows):
            return True  # at the first rows back: the run ends at the last step handed out

    cfg = config(tmp_path, compress="topk:0.05", checkpoint_steps=0, segment_steps=2)
    group = DummyGroup(cfg)
    plan = Plan(Path(cfg.run_dir), 1, None)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    ctl = Controller(cfg, plan, RunState.create(cfg, plan), group, lambda event: None, Callbacks([StopEarly()]))
    assert ctl.run().summary["status"] == "stopped"
    saved = load_checkpoint(Path(cfg.run_dir) / "checkpoints" / "final.pt")
    stop = saved["global_step"]
    assert 0 < stop < STEPS and stop % 2 == 0  # the end moved to a segment's end
    residuals = {r: s["grads"]["residual"].tolist() for r, s in saved["channel"]["ranks"].items()}
    assert residuals == {0: [0, stop], 1: [1, stop]}  # each rank's own, taken at the stop


def test_a_shared_plan_s_step_checkpoints_say_why_they_hold_no_codec_state_its_final_holds_all(tmp_path):
    """Async under the PS hands units to whoever asks: no moment has every worker at a step checkpoint's
    step, so it holds no codec state and says why (a resume from it words its notice by that); at the
    end nobody trains any more, so the final checkpoint holds every worker's state as it is then."""
    from distrain.orchestrator.channel_checkpoint import restore

    cfg = config(tmp_path, strategy="async", transport="ps", compress="topk:0.05")
    controller(cfg, DummyGroup(cfg))[0].run()
    saved = load_checkpoint(Path(cfg.run_dir) / "checkpoints" / "step-00000008.pt")
    assert "channel" not in saved and saved["channel_none"] == "shared"
    assert "at different steps" in restore(saved, [0, 1], "topk:0.05")[1]
    final = load_checkpoint(Path(cfg.run_dir) / "checkpoints" / "final.pt")
    assert set(final["channel"]["ranks"]) == {0, 1} and "channel_none" not in final


def test_without_a_codec_a_checkpoint_holds_no_codec_state(tmp_path):
    cfg = config(tmp_path)
    controller(cfg, DummyGroup(cfg))[0].run()
    assert "channel" not in load_checkpoint(Path(cfg.run_dir) / "checkpoints" / "final.pt")


def test_a_parameter_server_worker_death_is_replaced_in_place_and_nothing_restarts(tmp_path):
    cfg = config(tmp_path, strategy="async")
    group = DummyGroup(cfg, die={1: 5})
    ctl, events = controller(cfg, group)
    s = ctl.run().summary
    assert s["status"] == "completed" and s["failures"] == 1 and s["replacements"] == 1
    (failure,) = s["failure_events"]
    assert failure["action"] == "replaced" and failure["target"] == 1 and failure["time_lost_s"] is not None
    assert group.restarts == 0 and group.log.count(("enter_phase", "async")) == 1  # the others went on
    kill = group.log.index(("kill", 1))
    assert ("start", [1]) in group.log[kill:] and ("setup", 1) in group.log[kill:]  # a fresh worker, same slot
    assert any(entry[0] == "rebase_clock" and entry[1][0] == 1 for entry in group.log[kill:])
    assert every_unit_once(cfg)  # the dead worker's units were handed out again, each kept once
    assert Stage.RECOVERING in ctl.machine.history and Stage.STARTING not in ctl.machine.history[1:]
    assert [e.replaced for e in events if isinstance(e, Failure)] == [True]


def test_past_max_failures_the_run_fails_with_its_one_line_and_records_it(tmp_path):
    cfg = config(tmp_path, max_failures=1)
    group = DummyGroup(cfg, die={1: 6, 0: 9})  # two deaths, one allowed
    ctl, _ = controller(cfg, group)
    with pytest.raises(RunFailed, match=r"--max-failures 1 reached.*last good checkpoint: .*step-0000000[48]"):
        ctl.run()
    s = summary(cfg)
    assert s["status"] == "failed" and s["failures"] == 2
    assert [e["action"] for e in s["failure_events"]] == ["restarted", "restarted"]  # the second as it called for
    assert group.restarts == 1 and ctl.machine.history[-1] == Stage.FAILED


def test_a_shard_death_restarts_the_run_with_fresh_shards(tmp_path):
    cfg = config(tmp_path, strategy="async")
    group = DummyGroup(cfg, shard_dies_at=6)
    ctl, _ = controller(cfg, group)
    s = ctl.run().summary
    assert s["status"] == "completed" and s["failures"] == 1 and s["replacements"] == 0
    (failure,) = s["failure_events"]
    assert (failure["kind"], failure["action"], failure["target"]) == ("shard", "restarted", None)
    assert group.restarts == 1 and group.log.count(("enter_phase", "async")) == 2  # shards set up again
    assert every_unit_once(cfg)


def test_an_elastic_run_takes_in_a_joiner_and_lets_a_member_leave_without_a_failure(tmp_path):
    cfg = config(tmp_path, strategy="async", workers="1..3", checkpoint_steps=0)
    group = DummyGroup(cfg, placed={0: 0, 1: 0, 2: 4}, die={1: 8})  # slot 2 has room from step 4; 1 dies at 8
    ctl, _ = controller(cfg, group)
    s = ctl.run().summary
    assert s["status"] == "completed" and s["failures"] == 0  # a leave above MIN is no failure
    m = s["membership"]
    changes = [(e["change"], e["rank"], e["cause"]) for e in m["events"]]
    assert changes == [
        ("join", 0, "start"),
        ("join", 1, "start"),
        ("join", 2, "placed"),
        ("leave", 1, "worker lost"),
    ]
    assert m["joins"] == 1 and m["leaves"] == 1 and m["final_members"] == 2
    assert ("kill", 1) in group.log and ("renew", 1) in group.log  # its slot asks for room again
    assert group.units_by_rank[2] > 0  # the joiner was fed
    assert Stage.RESIZING in ctl.machine.history and Stage.RECOVERING not in ctl.machine.history
    assert every_unit_once(cfg)  # the leaver's units were redone by the others


def test_a_leave_after_rows_without_a_clock_rebases_no_clock_onto_the_shards(tmp_path):
    """Backup tasks' rows carry no clock: a member leaving after them must not have its shard clock set
    to None (a shard then fails comparing clocks: the run ended `failed` in CI once)."""
    cfg = config(tmp_path, strategy="async", workers="1..3", checkpoint_steps=0, segment_steps=2)
    group = DummyGroup(cfg, placed={0: 0, 1: 0, 2: 4}, die={1: 8}, clockless=True)  # 1 sent rows before it died
    ctl, _ = controller(cfg, group)
    s = ctl.run().summary
    assert s["status"] == "completed" and s["membership"]["leaves"] == 1
    rebased = [args for name, args in group.log if name == "rebase_clock"]
    assert rebased and all(isinstance(clock, int) for _, clock in rebased), rebased
    assert all(isinstance(clock, int) for clock in group.clocks)


def test_an_elastic_leave_that_would_go_below_min_is_a_failure_decided_by_the_policy(tmp_path):
    cfg = config(tmp_path, strategy="async", workers="2..3")
    group = DummyGroup(cfg, placed={0: 0, 1: 0}, die={1: 6})
    ctl, _ = controller(cfg, group)
    s = ctl.run().summary
    assert s["status"] == "completed" and s["failures"] == 1 and s["membership"]["leaves"] == 0
    assert s["failure_events"][0]["action"] == "replaced"  # the PS takes a replacement in place instead


def test_a_chaos_kill_at_its_step_is_found_as_a_crash_and_recovered(tmp_path):
    cfg = config(tmp_path, chaos="kill-worker@6:1")
    group = DummyGroup(cfg)
    ctl, _ = controller(cfg, group)
    s = ctl.run().summary
    (record,) = s["chaos"]
    assert record["fired"] and record["fired_step"] == 6 and record["target"] == 1
    assert s["status"] == "completed" and s["failures"] == 1
    assert s["failure_events"][0]["at_step"] == 6 and s["failure_events"][0]["restored_step"] == 4
    # Nothing past the hold ran before the fault: step 6 was first trained after the restart.
    assert group.trained[(5, 1)] == 2 and group.trained[(6, 1)] == 1
    assert every_unit_once(cfg)


def test_an_interrupt_ends_the_run_interrupted_with_what_it_recorded(tmp_path):
    cfg = config(tmp_path)
    group = DummyGroup(cfg, interrupt_at=5)
    ctl, _ = controller(cfg, group)
    with pytest.raises(KeyboardInterrupt):
        ctl.run()
    s = summary(cfg)
    assert s["status"] == "interrupted" and s["failures"] == 0
    assert ctl.machine.history[-1] == Stage.INTERRUPTED
    assert not (Path(cfg.run_dir) / "checkpoints" / "final.pt").exists()
    assert latest_checkpoint(Path(cfg.run_dir) / "checkpoints") is not None  # step 4's stays to resume from


def test_a_resumed_run_goes_on_from_its_checkpoint_with_its_rows(tmp_path):
    cfg = config(tmp_path)
    ctl, _ = controller(cfg, DummyGroup(cfg, interrupt_at=9))
    with pytest.raises(KeyboardInterrupt):
        ctl.run()
    path = latest_checkpoint(Path(cfg.run_dir) / "checkpoints")
    assert path is not None
    checkpoint = load_checkpoint(path)
    start = int(checkpoint["global_step"])
    assert start in (4, 8)
    plan = Plan(Path(cfg.run_dir), 1, checkpoint, True, path, rows=recorded_rows(cfg, checkpoint))
    group = DummyGroup(cfg)
    ctl, events = controller(cfg, group, plan)
    s = ctl.run().summary
    assert s["status"] == "completed"
    assert ("load_state", float(start)) in group.log  # the checkpoint's model, into every worker
    assert min(step for step, _ in group.trained) == start  # nothing before it trained again
    assert every_unit_once(cfg)  # the rows before it read back, the rest trained now
    assert final_weight(cfg) == STEPS
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.tensor([float(start)]))


def test_an_epoch_and_a_step_checkpoint_of_the_same_step_are_both_written(tmp_path):
    # Epochs of 2 steps (2 x 256 of the digits' training set), an epoch checkpoint each and a step one
    # every 2 steps: steps 2, 4, ... get both. Their states come back while the epoch's evaluation is
    # still out, so both wait; neither may take the other's place.
    cfg = config(tmp_path, batch_size=256, max_steps=6, checkpoint_every=1, checkpoint_steps=2, eval_every=1)
    ctl, _ = controller(cfg, DummyGroup(cfg))
    assert ctl.run().summary["status"] == "completed"
    names = {p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir()}
    assert {"epoch-0001.pt", "step-00000002.pt", "epoch-0002.pt", "step-00000004.pt", "final.pt"} <= names
