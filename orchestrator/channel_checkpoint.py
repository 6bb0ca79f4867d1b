"""Each rank's codec state (error-feedback residuals, PowerSGD's warm start) in checkpoints.

The residuals are local: every rank keeps what its codec has not sent yet, so a checkpoint needs all of
them, not rank 0's. A worker whose segment ends where a checkpoint is taken ships its channel's
`state_dict()` with that segment's rows (orchestrator/worker.py); the driver keeps them here by step and
puts every member's into the checkpoint written at that step, under "channel":

    {"codec": "topk:0.05", "ranks": {0: {stream: state, ...}, 1: ...}}

A checkpoint gets the entry only when every member's state at exactly its step is in: half the ranks'
residuals would be worse than none. Which checkpoints those are:
- a step or epoch checkpoint of a static plan (orchestrator/checkpoint_schedule.py says where; the
  work plan ends every worker's segments there, and the workers ship by the same schedule);
- the final one, of any run: once every call is done nobody trains any more, so each member's state
  now is its state at the end; the controller asks each member whose segments did not ship it (a
  callback's stop moved the end after they were sent; a shared plan's members end elsewhere);
- not a shared plan's periodic ones (async under the PS, elastic runs over the PS: units go to whichever
  worker asks). Those cannot be exact: when the checkpoint's state is taken (behind one worker's queue)
  the other workers are mid-way through units past its step, some of them pushed into that very state
  already, and a rank's residuals are those of every push it made so far. No moment has every member
  at the checkpoint's step (nor is the state itself only the steps before it: a resume redoes the units
  past it), so such a checkpoint records why it holds none (`WHY`), and a resume says so;
- not a draining node's: over the PS taken mid-segment (a shared plan's as well); over the collective
  taken at a block boundary (orchestrator/controller/collective_scaling.py), where every member is at
  its step, so asking them as the final checkpoint does would work, but a round a lost member broke may
  have moved a survivor's residuals (encoded, never applied) and that is not pinned by any test yet:
  left as it is, with the general notice.

Restoring: each rank gets its own entry back (`restore`) when the run goes on with the same codec and the
same ranks (--resume, a restart after a failure). Otherwise (a checkpoint from before this was kept, a
different number of workers or membership, another codec, --init-from) the residuals start at zero, as
they always did before, and the run says so once.
"""

from __future__ import annotations

from typing import Any

KEY = "channel"  # the checkpoint's entry (orchestrator/checkpoint.py, VERSION 2)
# A checkpoint under a codec that cannot hold the entry says why (an optional entry: older readers
# ignore it); `restore` words the one-line notice by it.
WHY = "channel_none"
SHARED = "shared"  # a shared plan's: its members are at different steps (see above)
BECAUSE = {
    SHARED: "its workers were at different steps when it was taken (units go to whichever worker asks), so no "
    "rank's residuals belong to its step",
}


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

    def missing(self, step: int, members: list[int]) -> list[int]:
        """The members whose state at `step` is not in."""
        return [rank for rank in members if rank not in self.by_step.get(step, {})]

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
        why = BECAUSE.get(checkpoint.get(WHY))
        if why is not None:
            return {}, f"{zero}: the checkpoint holds none, as {why}"
        return {}, f"{zero}: the checkpoint holds none (an older version's, --init-from's or a mid-segment one)"
    if saved.get("codec") != codec:
        return {}, f"{zero}: the checkpoint's is for {saved.get('codec')}"
    ranks = saved.get("ranks", {})
    if set(ranks) != set(members):
        held = f"{len(ranks)} workers" if len(ranks) != len(members) else f"workers {sorted(ranks)}"
        now = f"{len(members)}" if len(ranks) != len(members) else f"{sorted(members)}"
        return {}, f"{zero}: the checkpoint holds it for {held}, this run starts with {now}"
    return {rank: {KEY: ranks[rank]} for rank in members}, None
