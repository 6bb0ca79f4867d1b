"""The line the progress display prints for each failure names what was lost in words."""

from __future__ import annotations

import pytest

from distrain.cli import RunDisplay
from distrain.config import RunConfig
from distrain.orchestrator.recovery import Failure, RunLost


@pytest.mark.parametrize(
    ("kind", "target", "words"),
    [
        ("worker", 1, "worker 1 lost"),
        ("worker", None, "a worker lost"),
        ("hang", 1, "worker 1 hung"),  # was "hang 1 lost"
        ("hang", None, "a parameter-server wait hung"),
        ("shard", 0, "parameter-server shard 0 lost"),
        ("shard", None, "a parameter-server shard lost"),
        ("node", None, "a node lost"),
    ],
)
def test_failure_line_names_what_was_lost(capsys, kind, target, words):
    display = RunDisplay(RunConfig())
    display.on_event(Failure(1, kind, target, 40, 30, 3))
    line = capsys.readouterr().out.strip()
    assert line == f"failure 1 (of at most 3): {words} at step 40; restarting from the checkpoint at step 30"
    assert str(RunLost(kind, target, "why")) == f"{words}: why"


def test_a_restart_with_no_checkpoint_to_restore_says_it_starts_from_the_start(capsys):
    """Issue 26: it said "restarting from the checkpoint at step 0" when no checkpoint had been taken."""
    display = RunDisplay(RunConfig())
    display.on_event(Failure(1, "worker", 0, 3, 0, 1, from_start=True))
    line = capsys.readouterr().out.strip()
    assert line == (
        "failure 1 (of at most 1): worker 0 lost at step 3; restarting from the start (no checkpoint was taken yet)"
    )
    display.on_event(Failure(1, "worker", 0, 3, 0, 1))  # --init-from's checkpoint at step 0 is one
    assert capsys.readouterr().out.strip().endswith("restarting from the checkpoint at step 0")
