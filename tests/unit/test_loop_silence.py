"""PhaseLoop's hang check (orchestrator/controller/loop.py): silence is timed per rank from its last answer,
and an answer that has arrived but waits for the loop to read it counts (the loop reads one result a turn,
so under load or a slow callback finished calls queue up behind it)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from distrain.orchestrator.controller.loop import PhaseLoop


def loop_with_two_busy_ranks(silent_for_s: float) -> PhaseLoop:
    loop = PhaseLoop.__new__(PhaseLoop)  # the hang check alone: no attempt, no group
    config = SimpleNamespace(collective_timeout_s=60.0, hang_timeout_s=5.0)
    loop.a = SimpleNamespace(config=config, group=SimpleNamespace(has_shards=lambda: False))
    loop.hang_limit = 5.0
    loop.dispatch = SimpleNamespace(pending={"h0": ("segment", 0, None), "h1": ("segment", 1, None)})
    loop.heard = [time.monotonic() - silent_for_s] * 2
    return loop


def test_a_rank_silent_past_the_limit_is_a_hang():
    lost = loop_with_two_busy_ranks(silent_for_s=10.0).silent_worker()
    assert lost is not None and lost.kind == "hang"


def test_a_finished_call_not_yet_read_is_an_answer():
    loop = loop_with_two_busy_ranks(silent_for_s=10.0)
    loop.heard_from(["h1"])  # rank 1's call is done, rank 0's is not
    lost = loop.silent_worker()
    assert lost is not None and lost.target == 0
    loop.heard_from(["h0", "h1"])
    assert loop.silent_worker() is None


def test_a_rank_within_the_limit_is_not_silent():
    assert loop_with_two_busy_ranks(silent_for_s=1.0).silent_worker() is None
