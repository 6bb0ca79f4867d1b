"""Each rank's codec state in checkpoints (orchestrator/channel_checkpoint.py): what a checkpoint at a step
carries (every member's state at exactly that step, or nothing), and who gets what back on a restore."""

from __future__ import annotations

import torch

from distrain.orchestrator.channel_checkpoint import KEY, SHARED, WHY, ChannelStates, restore


def state(value: float) -> dict:
    return {"grads": {"reducer": {"codec": "topk:0.05", "residual": torch.full((3,), value)}}}


def test_a_checkpoint_carries_every_member_s_state_of_its_step():
    states = ChannelStates()
    states.add(1, {"step": 8, "state": state(1.0)})
    states.add(0, {"step": 8, "state": state(0.0)})
    states.add(0, {"step": 16, "state": state(2.0)})
    entry = states.take(8, [0, 1], "topk:0.05")
    assert entry is not None and entry["codec"] == "topk:0.05"
    assert list(entry["ranks"]) == [0, 1]  # in rank order, each its own
    assert entry["ranks"][1]["grads"]["reducer"]["residual"][0] == 1.0
    assert states.take(8, [0, 1], "topk:0.05") == entry  # the final checkpoint at an epoch checkpoint's step
    assert states.take(16, [0, 1], "topk:0.05") is None  # rank 1's state at 16 never came: none, not half
    assert list(states.by_step) == [16]
    assert states.take(24, [0, 1], "topk:0.05") is None and states.by_step == {}  # older ones dropped


def test_no_codec_or_no_members_carries_nothing():
    states = ChannelStates()
    states.add(0, {"step": 4, "state": state(0.0)})
    assert states.take(4, [0], None) is None
    assert states.take(4, [], "int8") is None


def test_the_same_ranks_and_codec_get_their_own_state_back():
    saved = {KEY: {"codec": "topk:0.05", "ranks": {0: state(0.0), 1: state(1.0)}}}
    per_rank, notice = restore(saved, [0, 1], "topk:0.05")
    assert notice is None
    assert per_rank[0][KEY] is saved[KEY]["ranks"][0] and per_rank[1][KEY] is saved[KEY]["ranks"][1]


def test_otherwise_the_residuals_start_at_zero_and_the_run_says_why():
    saved = {KEY: {"codec": "topk:0.05", "ranks": {0: state(0.0), 1: state(1.0)}}}
    older = {"model": {}}  # written before the channel state was kept (version 1)
    per_rank, notice = restore(older, [0, 1], "topk:0.05")
    assert per_rank == {} and "starts at zero" in notice and "holds none" in notice
    per_rank, notice = restore(saved, [0, 1, 2], "topk:0.05")
    assert per_rank == {} and "2 workers, this run starts with 3" in notice
    per_rank, notice = restore(saved, [0, 2], "topk:0.05")  # elastic: as many members, other slots
    assert per_rank == {} and "[0, 1]" in notice and "[0, 2]" in notice
    per_rank, notice = restore(saved, [0, 1], "int8")
    assert per_rank == {} and "topk:0.05" in notice
    assert restore(saved, [0, 1], None) == ({}, None)  # no codec now: nothing to restore, nothing to say
    assert restore(older, [0, 1], None) == ({}, None)


def test_under_a_static_plan_a_checkpoint_waits_for_every_member_s_segment_up_to_its_step():
    states = ChannelStates()
    assert states.complete(8, [0, 1])  # not waiting (no codec, or a shared plan): as before
    states.wait = True
    states.reported_to(0, 12)  # rank 0 is ahead; rank 1's segment ending at 8 is not back yet
    assert not states.complete(8, [0, 1])
    states.reported_to(1, 8)
    states.reported_to(1, 4)  # an older segment's answer does not move it back
    assert states.complete(8, [0, 1]) and not states.complete(12, [0, 1])


def test_a_checkpoint_that_could_hold_no_codec_state_says_why_in_the_notice():
    per_rank, notice = restore({"model": {}, WHY: SHARED}, [0, 1], "topk:0.05")
    assert per_rank == {} and "starts at zero" in notice and "at different steps" in notice
    assert "\n" not in notice
    per_rank, notice = restore({"model": {}, WHY: "a reason of a later version"}, [0, 1], "topk:0.05")
    assert "holds none (an older version's" in notice  # a reason it does not know: the general line


def test_missing_lists_the_members_whose_state_of_a_step_is_not_in():
    states = ChannelStates()
    states.add(1, {"step": 8, "state": state(1.0)})
    assert states.missing(8, [0, 1, 2]) == [0, 2] and states.missing(4, [1]) == [1]
