"""--balance speed under `--workers MIN..MAX` (BSP over the collective transport): the speed balancer
(balance.py) over whoever is a member now.

Every step is the configured global batch B, whatever the membership: its samples are cut among the
members in slot order (trainers/shares.py `slot_shares`, 0 where a slot has no member), so the update is
always the whole batch's mean and an epoch's samples are each seen once, as in a fixed-size run. The
scaling policy tells the balancer the members at each re-form (`follow`): a joiner starts at the mean
share of the current members and a leaver's share goes to the others in proportion (`reshare`); from
there the balancer moves the shares by measured speed as in a fixed run (a joiner's speed is known once
it has rows at its share: until then nothing moves). A member that stays keeps its rows (samples,
seconds): those at its share before the change give the affine model its slope at once. A slot that
rejoins is a new worker, maybe on another node: its speed is measured afresh.

The base balancer works on the members in group order (its `current` and `rows` are theirs); what goes
out (`shares_for`, `summary`) is per slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from distrain.orchestrator.balance import ShareBalancer
from distrain.trainers.shares import reshare, slot_shares


class ElasticShareBalancer(ShareBalancer):
    def __init__(self, slots: int, global_batch: int, **kw: Any) -> None:
        super().__init__(slots, global_batch, **kw)
        self.slots = slots
        self.members: list[int] = []
        self.windows: dict[int, deque] = {}  # slot -> its member's recent rows (the base's `rows`, by slot)
        self.empty = self.rows[0]  # an empty window of the base's kind (its maxlen), never filled: copied
        self.current, self.rows = (), []  # no members until the first re-form (`follow`)

    def follow(self, members: Sequence[int], step: int) -> None:
        """The group was re-formed with `members` (slots, group order) before global step `step`."""
        members = list(members)
        if members == self.members:
            return
        before = dict(zip(self.members, self.current, strict=True))
        shares = reshare(before, members, self.global_batch)
        self.windows = {m: self.windows[m] if m in before else self.empty.copy() for m in members}
        self.members = members
        self.rows = [self.windows[m] for m in members]
        self.current = tuple(shares[m] for m in members)
        self.decided = {}  # decisions made for the old membership (a lost block's steps are dealt again)
        self.pending = None  # a move proposed for the old membership is not one for the new
        if before:  # (the first membership is the start, not a move)
            joined = [m for m in members if m not in before]
            self.moves.append({"step": step, "shares": list(self.per_slot(self.current)), "joined": joined})

    def add(self, workers: Sequence[int], compute_s: Sequence[float], samples: Sequence[int]) -> None:
        """Rows of members only (a leaver's last rows come in after it left), indexed as the base keeps them."""
        kept = [
            (self.members.index(w), c, n)
            for w, c, n in zip(workers, compute_s, samples, strict=True)
            if w in self.members
        ]
        if kept:
            index, seconds, counts = zip(*kept, strict=True)
            super().add(index, seconds, counts)

    def per_slot(self, shares: Sequence[int]) -> tuple[int, ...]:
        return slot_shares(dict(zip(self.members, shares, strict=True)), self.slots)

    def shares_for(self, start_step: int) -> tuple[int, ...]:
        """The shares of the segment starting at `start_step`, one count per slot (0: no member)."""
        moved = len(self.moves)
        shares = super().shares_for(start_step)
        for move in self.moves[moved:]:  # the base's move, in the members' order: per slot
            move["shares"] = list(self.per_slot(move["shares"]))
        return self.per_slot(shares)

    def summary(self) -> dict[str, Any]:
        return {"final_shares": list(self.per_slot(self.current)), "moves": self.moves, "members": self.members}
