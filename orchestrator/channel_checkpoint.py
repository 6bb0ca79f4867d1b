"""Each rank's codec state (error-feedback residuals, PowerSGD's warm start) in checkpoints.

The residuals are local: every rank keeps what its codec has not sent yet, so a checkpoint needs all of
them, not rank 0's. A worker whose segment ends where a checkpoint is taken ships its channel's
`state_dict()` with that segment's rows (orchestrator/worker.py); the driver keeps them here by step and
puts every member's into the checkpoint written at that step, under "channel":

    {"codec": "topk:0.05", "ranks": {0: {stream: state, ...}, 1: ...}}

A checkpoint gets the entry only when every member's state at exactly its step is in (a step or epoch
checkpoint, the final one; not a draining node's, taken mid-segment, nor a shared plan's whose members'
segments end elsewhere): half the ranks' residuals would be worse than none.

Restoring: each rank gets its own entry back (`restore`) when the run goes on with the same codec and the
same ranks (--resume, a restart after a failure). Otherwise (a checkpoint from before this was kept, a
different number of workers or membership, another codec, --init-from) the residuals start at zero, as
they always did before, and the run says so once.
"""

from __future__ import annotations

from typing import Any

KEY = "channel"  # the checkpoint's entry (orchestrator/checkpoint.py, VERSION 2)


class ChannelStates:
    """The ranks' codec states shipped with their segments, by the step they were taken at, until a
    checkpoint at that step is written."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[int, dict[str, Any]]] = {}
        self.reported: dict[int, int] = {}  # rank -> steps done at the end of its latest segment back
        # Whether a checkpoint waits for every member's segment up to its step (a static plan under a
        # codec): under the PS a step's rows can all be in (the count of units) before a slower rank's
        # segment ending there, with its residuals, is back. A shared plan's members need not pass the step.
        self.wait = False

    def reported_to(self, rank: int, end: int) -> None:
        """Rank `rank`'s segment ending after `end` steps came back (with its state, if one was due)."""
        self.reported[rank] = max(self.reported.get(rank, 0), end)

    def complete(self, step: int, members: list[int]) -> bool:
        """Whether a checkpoint at `step` may be written now as far as the codec state goes."""
        return not self.wait or all(self.reported.get(rank, 0) >= step for rank in members)

    def add(self, rank: int, snapshot: dict[str, Any]) -> None:
        """`snapshot`: a segment's {"step": steps done, "state": its channel's state_dict()}."""
        self.by_step.setdefault(int(snapshot["step"]), {})[rank] = snapshot["state"]

    def take(self, step: int, members: list[int], codec: str | None) -> dict[str, Any] | None:
        """The checkpoint entry for `step` (every member's state), or None where some member's is missing.
        Earlier snapshots are dropped (checkpoints are written in step order); those of `step` stay for
        another checkpoint at the same step (an epoch's and the final one)."""
        ranks = self.by_step.get(step, {})
        for earlier in [s for s in self.by_step if s < step]:
            del self.by_step[earlier]
        if not codec or not members or set(ranks) != set(members):
            return None
        return {"codec": codec, "ranks": {rank: ranks[rank] for rank in sorted(ranks)}}


def restore(
    checkpoint: dict[str, Any], members: list[int], codec: str | None
) -> tuple[dict[int, dict[str, Any]], str | None]:
    """Each member's codec state to load ({rank: {"channel": state}}, empty: none), and the one line to
    say when a run under a codec starts its residuals at zero instead (None: nothing to say)."""
    if not codec:
        return {}, None
    saved = checkpoint.get(KEY)
    zero = f"the codec's error-feedback state ({codec}) starts at zero"
    if saved is None:
        return {}, f"{zero}: the checkpoint holds none (an older version's, --init-from's or a mid-segment one)"
    if saved.get("codec") != codec:
        return {}, f"{zero}: the checkpoint's is for {saved.get('codec')}"
    ranks = saved.get("ranks", {})
    if set(ranks) != set(members):
        held = f"{len(ranks)} workers" if len(ranks) != len(members) else f"workers {sorted(ranks)}"
        now = f"{len(members)}" if len(ranks) != len(members) else f"{sorted(members)}"
        return {}, f"{zero}: the checkpoint holds it for {held}, this run starts with {now}"
    return {rank: {KEY: ranks[rank]} for rank in members}, None
