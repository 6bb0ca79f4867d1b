"""The portions of one round (backup tasks) or one data pass (Sandblaster), as both schedulers hand them out:
MapReduce's rule for backup copies, and a lost worker's portions back to the front. Pure: no Ray, no asyncio
(the actors that hold a queue, both a `PortionHandout` of strategies/portion_scheduler.py, take their own
locks around it).

A hand-out is a chunk: `count` portions in a row from `start`, computed as one batch and pushed as one
gradient (Sandblaster's coordinator always takes one; backup tasks' scheduler sizes them,
strategies/portion_scheduler.py). Chunks of one round never overlap: fresh portions are joined only with
fresh neighbours, and a chunk handed out is copied, or given back by a lost worker, whole.

Speculation rule ("near the end of a phase"): once every portion has been handed out, a worker that asks
gets a copy of an outstanding chunk it does not hold and that has no copy yet: first those held by workers
flagged slow, then the longest-running; a scheduler may pass `worth` to copy only where the copy is expected
to finish first. Workers flagged slow never receive copies.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# (holder, when it started the chunk, portions in it) -> whether a copy is worth making
Worth = Callable[[int, float, int], bool]


class PortionQueue:
    def __init__(self, size: int) -> None:
        self.size = size  # portions in the round or pass
        self.unassigned: deque[tuple[int, int]] = deque((p, 1) for p in range(size))  # (start, count)
        self.returned: set[int] = set()  # starts of chunks a lost worker gave back: handed out as they were
        self.running: dict[int, list[tuple[int, float]]] = {}  # chunk start -> [(worker, start time)]
        self.counts: dict[int, int] = {}  # chunk start -> its portions (once handed out)
        self.done: set[int] = set()  # portions in

    @property
    def left(self) -> int:
        """Portions not handed out yet."""
        return sum(count for _, count in self.unassigned)

    def take(
        self,
        worker: int,
        slow: set[int],
        count: int = 1,
        copies: bool = True,
        worth: Worth | None = None,
        fresh: bool = True,
    ) -> tuple[int, int, bool] | None:
        """(start, portions, is a copy) for `worker`, recorded as running: up to `count` fresh portions in a
        row, else a copy (only a copy where not `fresh`); None: nothing for it now."""
        if self.unassigned and fresh:
            start, n = self.unassigned.popleft()
            if start in self.returned:
                self.returned.discard(start)
            else:
                while n < count and self.unassigned and self.unassigned[0][0] == start + n:
                    if self.unassigned[0][0] in self.returned:
                        break
                    n += self.unassigned.popleft()[1]
            self.counts[start] = n
            return self._assign(worker, start), n, False
        if not copies or worker in slow:
            return None
        candidates = [
            (holders[0][0] not in slow, holders[0][1], start)
            for start, holders in self.running.items()
            if len(holders) == 1 and holders[0][0] != worker
            and (worth is None or worth(holders[0][0], holders[0][1], self.counts[start]))
        ]  # fmt: skip
        if not candidates:
            return None
        start = min(candidates)[2]
        return self._assign(worker, start), self.counts[start], True

    def next_for(self, worker: int, slow: set[int], copies: bool = True) -> tuple[int, bool] | None:
        """One portion at a time: (portion, is a copy) for `worker`, recorded as running; None: nothing now."""
        taken = self.take(worker, slow, 1, copies)
        return None if taken is None else (taken[0], taken[2])

    def _assign(self, worker: int, start: int) -> int:
        self.running.setdefault(start, []).append((worker, time.monotonic()))
        return start

    def complete(self, start: int) -> bool:
        """The chunk at `start` is in (every shard has it); False when it was already (a copy's twin came first)."""
        if start in self.done:
            return False
        self.done.update(range(start, start + self.counts.get(start, 1)))
        self.running.pop(start, None)
        return True

    @property
    def all_done(self) -> bool:
        return len(self.done) == self.size

    def worker_lost(self, worker: int) -> int:
        """`worker` left: the chunks only it held go back to the front of the queue, whole; returns how many
        portions."""
        back = 0
        for start, holders in list(self.running.items()):
            rest = [h for h in holders if h[0] != worker]
            if len(rest) == len(holders):
                continue
            if rest:
                self.running[start] = rest
            else:
                del self.running[start]
                self.unassigned.appendleft((start, self.counts[start]))
                self.returned.add(start)
                back += self.counts[start]
        return back
