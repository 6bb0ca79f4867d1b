"""benchmarks/pipeline_idle.py's arithmetic (issue 32): hand-offs read from a pipeline's spans, and GPipe
replayed with free hand-offs, each stage on its own core or sharing fewer cores."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from distrain.strategies.pipeline import bubble_fraction

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline_idle.py"
_SPEC = importlib.util.spec_from_file_location("pipeline_idle", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def equal_spans(stages: int, micro: int) -> dict:
    return {(k, s, m): 1.0 if k == "F" else 2.0 for k in "FB" for s in range(stages) for m in range(micro)}


@pytest.mark.parametrize("stages, micro", [(2, 1), (2, 8), (4, 8), (3, 5)])
def test_replay_with_equal_stages_and_free_hand_offs_gives_the_bubble_formula(stages, micro):
    work = equal_spans(stages, micro)
    assert bench.replay(work, stages, micro) == pytest.approx([bubble_fraction(stages, micro)] * stages)
    # As many cores as stages: sharing changes nothing.
    assert bench.replay_on_cores(work, stages, micro, stages) == pytest.approx(bench.replay(work, stages, micro))


def test_sharing_two_cores_among_four_stages_stretches_the_spans_so_they_idle_less_as_counted():
    work = equal_spans(4, 8)
    two = bench.replay_on_cores(work, 4, 8, 2)
    assert all(idle < bubble_fraction(4, 8) for idle in two)  # spans shared by two stages last twice as long


def test_a_hand_off_is_from_the_later_of_the_sender_s_end_and_the_receiver_s_own_last_end():
    spans = {
        ("F", 0, 0): (0.0, 1.0),
        ("F", 0, 1): (1.0, 2.0),
        ("F", 1, 0): (1.5, 2.5),  # waited for stage 0: 0.5 s from its end
        ("F", 1, 1): (2.75, 3.0),  # stage 0 was done at 2.0, stage 1 itself at 2.5: 0.25 s, not waited on
        ("B", 1, 0): (3.0, 4.0),
        ("B", 1, 1): (4.0, 5.0),
        ("B", 0, 0): (4.5, 5.5),  # gradient from stage 1's B0 (end 4.0); stage 0 free since 2.0: 0.5 s
        ("B", 0, 1): (5.5, 6.0),  # stage 1's B1 ended 5.0, stage 0's own B0 at 5.5: 0.0 s
    }
    assert bench.handoffs(spans, 2, 2) == [
        (0, 0.5, True),
        (0, 0.0, False),
        (1, 0.5, True),
        (1, 0.25, False),
    ]
