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
