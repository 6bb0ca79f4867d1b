"""The one portion queue behind backup tasks' scheduler and Sandblaster's coordinator
(strategies/portion_queue.py): first every portion once, then copies by MapReduce's rule. No Ray."""

from __future__ import annotations

import pytest

from distrain.strategies.portion_queue import PortionQueue


def test_each_portion_once_then_copies_of_the_slow_workers_first():
    q = PortionQueue(3)
    assert [q.next_for(w, set()) for w in (0, 1, 2)] == [(0, False), (1, False), (2, False)]
    # worker 0 is free again: a copy, first of what the slow worker 2 holds, though 1's started earlier
    assert q.next_for(0, slow={2}) == (2, True)
    assert q.next_for(2, slow={2}) is None  # a slow worker never gets a copy
    assert q.next_for(1, slow=set(), copies=False) is None  # Sandblaster without --backup-tasks
    assert q.next_for(1, slow=set()) == (0, True)  # the longest-running single-held portion not its own
    assert q.next_for(1, slow=set()) is None  # every portion has its copy now


def test_a_portion_counts_once_and_the_queue_is_through_when_all_are_in():
    q = PortionQueue(2)
    q.next_for(0, set()), q.next_for(1, set()), q.next_for(0, set())  # portion 1 copied by worker 0
    assert q.complete(1) and not q.complete(1)  # the twin that arrives second changes nothing
    assert not q.all_done
    assert q.complete(0) and q.all_done


def test_a_lost_worker_gives_back_only_what_no_one_else_holds():
    q = PortionQueue(3)
    for w in (0, 1, 2):
        q.next_for(w, set())
    q.next_for(1, set())  # worker 1 copies portion 0
    assert q.worker_lost(0) == 0  # portion 0 still has worker 1's copy
    assert q.worker_lost(2) == 1  # portion 2 goes back, to the front
    assert q.next_for(0, set()) == (2, False)


def test_chunks_join_fresh_portions_in_a_row_and_count_once_whole():
    q = PortionQueue(5)
    assert q.take(0, set(), count=2) == (0, 2, False)
    assert q.left == 3
    assert q.take(1, set(), count=9) == (2, 3, False)  # no more than is left
    assert q.left == 0
    assert q.take(2, set(), count=1) == (0, 2, True)  # a copy is of a whole chunk (the longest-running)
    assert q.complete(2) and not q.complete(2)  # a chunk's twin, whichever comes second, changes nothing
    assert q.done == {2, 3, 4} and not q.all_done
    assert q.complete(0) and q.all_done and not q.complete(0)


def test_a_lost_worker_s_chunk_comes_back_whole_and_is_not_joined_with_fresh_portions():
    q = PortionQueue(6)
    assert q.take(0, set(), count=2) == (0, 2, False)
    assert q.take(1, set(), count=1) == (2, 1, False)
    assert q.worker_lost(0) == 2  # portions, not chunks
    assert q.take(2, set(), count=4) == (0, 2, False)  # handed out as it was: never overlapping a pushed twin
    assert q.take(2, set(), count=4) == (3, 3, False)


def test_a_copy_is_made_only_where_worth_says_so():
    q = PortionQueue(2)
    q.take(0, set(), count=1), q.take(1, set(), count=1)
    asked = []
    assert q.take(2, set(), worth=lambda holder, started, n: asked.append((holder, n)) or holder == 1) == (1, 1, True)
    assert sorted(asked) == [(0, 1), (1, 1)]
    assert q.take(3, set(), worth=lambda holder, started, n: False) is None


def test_a_chunk_s_row_becomes_one_row_per_portion():
    from distrain.strategies.backup_tasks import per_portion

    rows = {
        "step": [5, 5, 6],
        "slice": [0, 4, 1],
        "samples": [96, 32, 32],
        "compute_s": [0.3, 0.1, 0.2],
        "h2d_s": [None, None, None],
        "bytes_sent": [600, 600, 600],
        "dropped": [False, True, False],
        "loss": [1.5, 2.0, 1.0],
        "broken": [{"rounds": 1}],  # not a per-row column: left alone
    }
    per_portion(rows, [3, 1])  # the third row (pushed past the books, e.g. a stop) is one portion
    assert rows["step"] == [5, 5, 5, 5, 6] and rows["slice"] == [0, 1, 2, 4, 1]
    assert rows["samples"] == [32, 32, 32, 32, 32]
    assert rows["compute_s"] == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.2])
    assert rows["bytes_sent"] == [600, 0, 0, 600, 600]  # a chunk's push once
    assert rows["dropped"] == [False, False, False, True, False] and rows["loss"] == [1.5] * 3 + [2.0, 1.0]
    assert rows["h2d_s"] == [None] * 5 and rows["broken"] == [{"rounds": 1}]


def test_a_segment_s_notes_to_the_driver_are_not_cut_even_when_one_row_long():
    from distrain.strategies.backup_tasks import per_portion

    rows = {"step": [3], "slice": [2], "samples": [64], "broken": [{"rounds": 0}]}
    per_portion(rows, [2])
    assert rows == {"step": [3, 3], "slice": [2, 3], "samples": [32, 32], "broken": [{"rounds": 0}]}
