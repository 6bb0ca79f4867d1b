"""--balance speed under `--workers MIN..MAX` (BSP, local SGD and DiLoCo over the collective transport):
the speed balancer (balance.py) over whoever is a member now, plain workers or cut replicas.

Every step is the configured global batch B, whatever the membership: its samples are cut among the
members in slot order (trainers/shares.py `slot_shares`, 0 where a slot has no member), so the update is
always the whole batch's mean and an epoch's samples are each seen once, as in a fixed-size run. The
scaling policy tells the balancer the members at each re-form (`follow`): a joiner starts at the mean
share of the current members and a leaver's share goes to the others in proportion (`reshare`); from
there the balancer moves the shares by measured speed as in a fixed run (a joiner's speed is known once
it has rows at its share: until then nothing moves). A member that stays keeps its rows (samples,
seconds): those at its share before the change give the affine model its slope at once. A slot that
rejoins is a new worker, maybe on another node: its speed is measured afresh.

Cut replicas (--fsdp D, --tensor-parallel T; strategies/elastic_cut.py): a slot is a replica of `per` =
D x T consecutive worker actors (rank = slot x per + i), which come and go together, and a share is whole
units of `unit` samples (config/shares_section.py `share_unit`: D data-parallel ranks x --accumulate-steps,
D x T under a hybrid plan). The base balancer then works in units (B / unit of them a step, a joiner at
the mean share in whole units) and keeps each actor's rows on its own, read at its replica's share (the
rows' `replica_samples`); a replica's model is its slowest worker's, as at a fixed size
(orchestrator/pipeline_balance.py). What goes out is samples again.

The base balancer works on the members in group order (its `current` is theirs, its `rows` their
actors'); what goes out (`shares_for`, `summary`) is per slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from distrain.orchestrator.balance import ShareBalancer, StepModel, fit_step_model
from distrain.trainers.shares import reshare, slot_shares


class ElasticShareBalancer(ShareBalancer):
    def __init__(self, slots: int, global_batch: int, per: int = 1, unit: int = 1, **kw: Any) -> None:
        if global_batch % unit:
            raise ValueError(f"a global batch of {global_batch} is not whole units of {unit} samples")
        super().__init__(slots, global_batch // unit, **kw)
        self.slots = slots
        self.per, self.unit = per, unit  # worker actors a slot spans; samples a unit of share is
        self.members: list[int] = []  # member slots, in group order
        self.windows: dict[int, deque] = {}  # actor -> its recent rows (the base's `rows`, by actor rank)
        self.empty = self.rows[0]  # an empty window of the base's kind (its maxlen), never filled: copied
        self.current, self.rows = (), []  # no members until the first re-form (`follow`)

    def actors(self, slots: Sequence[int]) -> list[int]:
        """The worker actors of `slots`, in order (slot s: ranks s x per .. s x per + per - 1)."""
        return [s * self.per + i for s in slots for i in range(self.per)]

    def follow(self, members: Sequence[int], step: int) -> None:
        """The group was re-formed with `members` (worker actors, group order: a cut replica's `per`
        together) before global step `step`."""
        slots = list(dict.fromkeys(m // self.per for m in members))
        if slots == self.members:
            return
        before = dict(zip(self.members, self.current, strict=True))
        shares = reshare(before, slots, self.global_batch)  # in units
        self.windows = {
            a: self.windows[a] if a // self.per in before else self.empty.copy() for a in self.actors(slots)
        }
        self.members = slots
        self.rows = [self.windows[a] for a in self.actors(slots)]
        self.current = tuple(shares[m] for m in slots)
        self.decided = {}  # decisions made for the old membership (a lost block's steps are dealt again)
        self.pending = None  # a move proposed for the old membership is not one for the new
        if before:  # (the first membership is the start, not a move)
            joined = [m for m in slots if m not in before]
            self.moves.append({"step": step, "shares": list(self.per_slot(self.current)), "joined": joined})

    def add_rows(self, rows: dict[str, list[Any]]) -> None:
        """A segment's rows: each actor's compute time at its replica's share (a cut replica's rows carry it
        as `replica_samples`; `samples` is the actor's own part, or 0 for a tensor-parallel mate)."""
        samples = rows["replica_samples"] if self.per > 1 else rows["samples"]
        self.add(rows["worker"], rows["compute_s"], [(n or 0) // self.unit for n in samples])

    def add(self, workers: Sequence[int], compute_s: Sequence[float], samples: Sequence[int]) -> None:
        """Rows of members' actors only (a leaver's last rows come in after it left), indexed as the base
        keeps them (in units)."""
        actors = self.actors(self.members)
        kept = [(actors.index(w), c, n) for w, c, n in zip(workers, compute_s, samples, strict=True) if w in actors]
        if kept:
            index, seconds, counts = zip(*kept, strict=True)
            super().add(index, seconds, counts)

    def share_of(self, worker: int) -> int:
        """Actor `worker` (its index among the members' actors) is measured at its replica's share."""
        return self.current[worker // self.per]

    def models(self, rows: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[StepModel] | None:
        """Each member's step model, a cut replica's its slowest worker's (`per` = 1: the base's)."""
        if self.per == 1:
            return super().models(rows)
        rows = self.rows if rows is None else rows
        if any(len(self.at_current(a, rows)) < self.min_rows for a in range(len(rows))):
            return None
        out = []
        for r, share in enumerate(self.current):
            fitted = [fit_step_model(rows[r * self.per + i], share, self.window) for i in range(self.per)]
            out.append(max(fitted, key=lambda m: m.time(share)))
        return out

    def per_slot(self, shares: Sequence[int]) -> tuple[int, ...]:
        """Member shares (units) as samples, one count per slot (0: no member)."""
        return slot_shares({m: u * self.unit for m, u in zip(self.members, shares, strict=True)}, self.slots)

    def shares_for(self, start_step: int) -> tuple[int, ...]:
        """The shares of the segment starting at `start_step`, in samples, one count per slot (0: no member)."""
        moved = len(self.moves)
        shares = super().shares_for(start_step)
        for move in self.moves[moved:]:  # the base's move, in the members' order and units: per slot
            move["shares"] = list(self.per_slot(move["shares"]))
        return self.per_slot(shares)

    def summary(self) -> dict[str, Any]:
        return {"final_shares": list(self.per_slot(self.current)), "moves": self.moves, "members": self.members}
