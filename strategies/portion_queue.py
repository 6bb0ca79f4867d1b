"""The portions of one round (backup tasks) or one data pass (Sandblaster), as both schedulers hand them out:
MapReduce's rule for backup copies, and a lost worker's portions back to the front. Pure: no Ray, no asyncio
(the actors that hold a queue, both a `PortionHandout` of strategies/portion_scheduler.py, take their own
locks around it).

Speculation rule ("near the end of a phase"): once every portion has been handed out, a worker that asks
gets a copy of an outstanding portion it does not hold and that has no copy yet: first those held by workers
flagged slow, then the longest-running. Workers flagged slow never receive copies.
"""

from __future__ import annotations

import time
from collections import deque


class PortionQueue:
    def __init__(self, size: int) -> None:
        self.size = size  # portions in the round or pass
        self.unassigned: deque[int] = deque(range(size))
        self.running: dict[int, list[tuple[int, float]]] = {}  # portion -> [(worker, start time)]
        self.done: set[int] = set()

    def next_for(self, worker: int, slow: set[int], copies: bool = True) -> tuple[int, bool] | None:
        """(portion, is a copy) for `worker`, recorded as running; None: nothing for it now."""
        if self.unassigned:
            return self._assign(worker, self.unassigned.popleft()), False
        if not copies or worker in slow:
            return None
        candidates = [
            (holders[0][0] not in slow, holders[0][1], portion)
            for portion, holders in self.running.items()
            if len(holders) == 1 and holders[0][0] != worker
        ]
        return (self._assign(worker, min(candidates)[2]), True) if candidates else None

    def _assign(self, worker: int, portion: int) -> int:
        self.running.setdefault(portion, []).append((worker, time.monotonic()))
        return portion

    def complete(self, portion: int) -> bool:
        """`portion` is in (every shard has it); False when it was already (a copy's twin came first)."""
        if portion in self.done:
            return False
        self.done.add(portion)
        self.running.pop(portion, None)
        return True

    @property
    def all_done(self) -> bool:
        return len(self.done) == self.size

    def worker_lost(self, worker: int) -> int:
        """`worker` left: the portions only it held go back to the front of the queue; returns how many."""
        back = 0
        for portion, holders in list(self.running.items()):
            rest = [h for h in holders if h[0] != worker]
            if len(rest) == len(holders):
                continue
            if rest:
                self.running[portion] = rest
            else:
                del self.running[portion]
                self.unassigned.appendleft(portion)
                back += 1
        return back
