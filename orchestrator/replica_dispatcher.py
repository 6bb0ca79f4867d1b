"""The dispatcher of an elastic run across cut replicas over the parameter server (`--fsdp D --transport
ps --workers MIN..MAX`, or `--tensor-parallel T`, or both; strategies/sharded_ps.py): the units are
shared, as in plain elastic runs over the PS, but a unit is a replica's: the plan (orchestrator/work.py,
shared) is kept over the MAX replica slots, and a replica's segment goes to its D x T workers together,
worker (d, t) taking slice s x D + d of replica unit s, a data-parallel rank's T workers the same slice
(a step stays MAX x D slices, each a B-sample unit, whoever is there; under a hybrid plan, whose T
workers each take their own samples, MAX x D x T, worker (d, t) slice s x D x T + d x T + t).

Worker ranks are replica-major (worker (d, t) of replica r is rank (r x D + d) x T + t); the dispatcher feeds a
replica through its worker 0 (`feed`), and a segment's D results are held back until all are in
(`collect`): then their rows are recorded together and the replica's units count once. A replica whose
worker is lost leaves whole (orchestrator/controller/scaling.py): the segments of its workers that were
not all back (`take_replica`) are handed out again, so every (epoch, step, slice) keeps exactly one row.
A segment that comes back broken (its worker's FSDP collective failed: a mate gone) is one of those: its
rows are dropped (`abandon`) and the replica leaves as for the lost mate.
"""

from __future__ import annotations

from typing import Any

from distrain.orchestrator.dispatcher import Dispatcher, Submit
from distrain.orchestrator.work import Unit, WorkPlan


class ReplicaDispatcher(Dispatcher):
    def __init__(self, work: WorkPlan, submit: Submit, per: int, ranks: int | None = None, **books: Any) -> None:
        """`per` workers to a replica (D x T); `ranks` data-parallel ranks among them (config/layout_section.py
        `data_ranks_per_replica`: D, or D x T under a hybrid plan; `per` when omitted)."""
        super().__init__(work, submit, **books)
        self.per = per
        # A replica unit is `ranks` slices; `per_unit` workers (a data-parallel rank's T, or 1 under a hybrid
        # plan: each tensor-parallel worker its own) take each slice together.
        self.ranks = per if ranks is None else ranks
        self.per_unit = per // self.ranks
        self.members = [s * per + d for s in range(work.workers) for d in range(per)]
        self.open_epoch = [None] * len(self.members)  # (static plans' books, indexed by worker rank)
        # A replica segment's results so far: (worker 0's rank, its replica units) -> {rank: result}
        self.parts: dict[tuple[int, tuple[Unit, ...]], dict[int, dict[str, Any]]] = {}
        # A replica's segments returned broken (a worker's FSDP collective failed: a mate gone), by its
        # worker 0's rank: their replica units, handed out again when the replica leaves (`take_replica`).
        self.abandoned: dict[int, list[Unit]] = {}

    def first(self, rank: int) -> int:
        return rank - rank % self.per

    def replica_units(self, units: list[Unit]) -> tuple[Unit, ...]:
        return tuple((e, s, sl // self.ranks) for e, s, sl in units)

    def call(self, kind: str, rank: int, payload: Any) -> None:
        """A replica's segment goes to each of its D x T workers, worker (d, t)'s slices s x D + d (its
        data-parallel rank's, shared by its T; s x D x T + d x T + t under a hybrid plan); other calls as
        they are (an evaluation or checkpoint on a replica reaches its workers in the group)."""
        if kind != "segment":
            super().call(kind, rank, payload)
            return
        first = self.first(rank)
        for w in range(self.per):
            units = [(e, s, sl * self.ranks + w // self.per_unit) for e, s, sl in payload]
            self.pending[self.submit(kind, first + w, units)] = (kind, first + w, units)

    def feed(self, rank: int) -> None:
        super().feed(self.first(rank))

    def feed_all(self) -> None:
        for rank in self.members:
            if rank % self.per == 0:
                self.feed(rank)

    def collect(self, rank: int, units: list[Unit], result: dict[str, Any]) -> bool:
        """Held back until the replica's D results for these units are in; the last one then carries
        every worker's rows (in worker order) and the loop records them."""
        key = (self.first(rank), self.replica_units(units))
        parts = self.parts.setdefault(key, {})
        parts[rank] = result
        if len(parts) < self.per:
            return True
        del self.parts[key]
        merged = {k: list(v) if isinstance(v, list) else v for k, v in parts[key[0]].items()}
        for r in sorted(parts)[1:]:
            for k, v in parts[r].items():
                if isinstance(v, list) and isinstance(merged.get(k), list):
                    merged[k].extend(v)
        result.clear()
        result.update(merged)
        return False

    def completed(self, rank: int, units: list[Unit]) -> None:
        """The replica's segment is whole: its replica units count once."""
        super().completed(self.first(rank), list(self.replica_units(units)))

    def abandon(self, rank: int, units: list[Unit]) -> None:
        """`rank`'s segment of `units` came back broken: its rows are dropped, its replica units go out
        again with the replica's others when the replica leaves."""
        redo = self.abandoned.setdefault(self.first(rank), [])
        redo.extend(u for u in self.replica_units(units) if u not in redo)

    def take_replica(self, rank: int) -> tuple[list[tuple[Any, Any]], list[Unit]]:
        """Every call queued on `rank`'s replica (a worker of it lost), and the replica units to hand out
        again: those of its segments not wholly back (their held-back results are dropped unrecorded)."""
        first = self.first(rank)
        calls = [c for r in range(first, first + self.per) for c in self.take(r)]
        redo: list[Unit] = self.abandoned.pop(first, [])
        for _, (kind, _, payload) in calls:
            if kind == "segment":
                redo.extend(u for u in self.replica_units(payload) if u not in redo)
        for key in [k for k in self.parts if k[0] == first]:
            del self.parts[key]
            redo.extend(u for u in key[1] if u not in redo)
        return calls, sorted(redo)

    def replica_in_flight(self, rank: int) -> int:
        first = self.first(rank)
        return sum(self.in_flight(r) for r in range(first, first + self.per))
