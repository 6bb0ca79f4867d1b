"""The one portion queue behind backup tasks' scheduler and Sandblaster's coordinator
(strategies/portion_queue.py): first every portion once, then copies by MapReduce's rule. No Ray."""

from __future__ import annotations

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
