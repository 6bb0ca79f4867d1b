"""`--chaos` bookkeeping without Ray: which events are refused up front, and what summary.json says
about events that could not fire (the injection itself is tested on a real Ray, test_fault_tolerance.py)."""

from __future__ import annotations

import pytest

from distrain.config import parse_chaos
from distrain.errors import ConfigError
from distrain.orchestrator.chaos import ChaosMonkey, refuse_unreachable


def test_an_event_at_or_past_the_last_step_is_refused_with_the_run_length():
    events = parse_chaos(["kill-worker@30:1", "hang-worker@44"], workers=2, ps_shards=None)
    with pytest.raises(ConfigError, match=r"'hang-worker@44': step 44 is not before the end of the run \(44 steps"):
        refuse_unreachable(events, total_steps=44)
    refuse_unreachable(events[:1], total_steps=44)  # step 30 of 44 is fine
    with pytest.raises(ConfigError, match=r"starts at step 40 \(--init-from\).*above 40"):
        refuse_unreachable(events[:1], total_steps=100, start_step=40)


def test_events_that_cannot_fire_are_reported_with_the_reason():
    events = parse_chaos(["kill-worker@5", "kill-ps@8", "hang-worker@20:0"], workers=2, ps_shards=1)
    monkey = ChaosMonkey(events)
    monkey.skip_reached(6)  # a run resumed from step 6
    assert monkey.next_step() == 8
    assert monkey.strike(8, workers=[], shards=[]) == []  # no shard runs at step 8 (e.g. a collective phase)
    assert monkey.next_step() == 20
    records = {r["event"]: r for r in monkey.summary(steps_done=12)}
    assert records["kill-worker@5"]["reason"] == "the run was resumed from step 6, past it"
    assert records["kill-ps@8"]["reason"] == "no parameter-server shard is running at that step"
    assert records["hang-worker@20:0"]["reason"] == "the run stopped at step 12, before it"
    assert all(not r["fired"] and r["fired_step"] is None for r in records.values())
    assert [r["requested_step"] for r in records.values()] == [5, 8, 20]


def test_the_run_summary_shows_when_each_fault_struck_and_why_one_did_not(capsys, tmp_path):
    from distrain.cli import print_summary

    monkey = ChaosMonkey(parse_chaos(["kill-ps@8", "hang-worker@20:0"], workers=2, ps_shards=1))
    monkey.strike(8, workers=[], shards=[])
    monkey.records[1] |= {"fired": True, "fired_step": 20}  # as strike records a fault it injected
    summary = {
        "run_id": "r", "strategy": "bsp", "workers": 2, "model": "mlp", "dataset": "digits", "epochs_completed": 1,
        "steps_completed": 22, "final_test_accuracy": 0.9, "target_accuracy": 0.95, "time_to_target_s": None,
        "wall_time_s": 3.0, "steady_state_samples_per_s": 1000.0, "bytes_per_step": 10, "mean_compute_s": 0.001,
        "mean_comm_s": 0.001, "chaos": monkey.summary(22),
    }  # fmt: skip
    print_summary(summary, tmp_path)
    text = capsys.readouterr().out
    assert "hang-worker@20:0 at 20" in text
    assert "--chaos kill-ps@8 did not fire: no parameter-server shard is running at that step" in text
