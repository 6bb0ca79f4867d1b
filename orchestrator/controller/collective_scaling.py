"""Elastic membership (`--workers MIN..MAX`) over the collective transport (BSP, local SGD, DiLoCo; issue
18) as the controller's scaling policy: `CollectiveScaling`, the counterpart of the parameter-server
transport's `ElasticScaling` (scaling.py), with the same books (orchestrator/membership.py's
`Membership`). strategies/elastic_group.py has the group the strategies share, bsp.py and local_sgd.py
the worker sides.

Under the collective transport every member holds the whole state (θ, optimizer state, fp16 loss
scale) and trains in lock-step, so a membership change means a new process group, and members change
only at a boundary all of them share. So such a phase's work comes in *blocks* (`needs_blocks`;
orchestrator/block_dispatcher.py's `BlockDispatcher`, run by the controller's one loop, loop.py): the
next `--segment-steps` rounds (local SGD: τ, the block ending in its average) are dealt to every member
at once (orchestrator/rounds.py) and the next block goes out only once all of them are back. This policy
has the same hooks from the loop as the parameter server's `ElasticScaling` (`begin`, `poll`,
`situation`, `leave`, `drained`). At each block's end (`poll`, `_end_block`) it records the rows of the
rounds that stand, lets the members lost in it leave through the loop's failure policy, re-forms, and
the boundary's evaluation and checkpoints go out from one member (all are equal); once they are back,
its turn at the boundary:
- handles a draining node (preemption, `_preempted`): at the next step boundary a checkpoint is written,
  then the members on that node leave (cause "node draining"); their slots ask for room again elsewhere;
- takes in joiners: a slot whose placement group got placed starts a worker as soon as it is seen
  (`WorkerGroup.start_joiner`); once the worker is built (its data loaded) it joins at the next boundary;
- re-forms the group when anything changed (`settle`, before the next block is dealt; `_reform`): a
  fresh rendezvous address hosted by the new group's rank 0, every member leaves its old group and
  joins the new one, and the whole replica state is broadcast from a member that trained on
  (`WorkerGroup.reform`, `TrainWorker.reform`); nothing is read from disk. Each re-form is recorded
  (membership summary `reforms`): who, the source, the parameters' digest on every member before and
  after, and the seconds it took.

`--chaos` works as in a fixed run: blocks stop at the next event's step (`WorkPlan.hold`), the fault
is injected at that boundary, and the next block finds it as it would find a crash: a killed
member's all-reduce peers fail, it leaves (a shrink while >= MIN) and its slot asks for room again; a
hung one is found when the group's timeout passes. `kill-node` is a node lost.

A node lost without warning fails the block's all-reduce: gloo raises on the closed peer
connection (or, at worst, the group's --collective-timeout-s passes), the survivors abandon the
round without applying it (`GroupBroken`, strategies/elastic_group.py) and return the rounds they
completed. Rounds every survivor completed stand (an all-reduce completes only with every member's
share, the lost one's included); the rest are redone after the re-form, which broadcasts from a
survivor at that round (in the rare case where some survivors completed a round the others did not,
the broadcast undoes it for them and their rows of it are dropped). The lost member's units in
rounds that stand were applied, but their rows died with it: they are listed in its leave event
(`units_without_row`) and never invented, as replacement.py does for BSP over the PS. Every loss goes
through the failure policy (`lost`, the loop's `lose`): a shrink, not a failure, while the membership
stays >= MIN (its LEAVE); below MIN it ends the attempt (RunLost) and the controller restarts from the last checkpoint.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from distrain.orchestrator.checkpoint import step_checkpoint_name
from distrain.orchestrator.controller.status import Stage
from distrain.orchestrator.elastic_balance import ElasticShareBalancer
from distrain.orchestrator.failure_policy import LEAVE as LEAVES
from distrain.orchestrator.failure_policy import USER_CODE, Situation
from distrain.orchestrator.membership import JOIN, LEAVE, Membership, leave_cause
from distrain.orchestrator.recovery import RunLost

if TYPE_CHECKING:
    from distrain.orchestrator.block_dispatcher import BlockDispatcher
    from distrain.orchestrator.controller.attempt import Attempt
    from distrain.orchestrator.controller.loop import PhaseLoop
    from distrain.orchestrator.work import Unit


def needs_blocks(attempt: Attempt) -> bool:
    """Whether the phase runs in lock-step blocks with this policy: an elastic phase over the collective
    transport (the parameter-server transport's members come and go between any two results)."""
    config = attempt.phase_config or attempt.config
    return attempt.membership is not None and attempt.impl.elastic and config.transport == "collective"


class CollectiveScaling:
    def __init__(self, attempt: Attempt, loop: PhaseLoop) -> None:
        assert attempt.membership is not None
        self.a = attempt
        self.group = attempt.group
        self.config = attempt.config
        self.loop = loop  # its `lose` decides on a block's losses; its last loss and metrics go to the display
        self.dispatch: BlockDispatcher = loop.dispatch  # type: ignore[assignment]
        self.plan = self.dispatch.work
        self.dispatch.before_deal = self.settle
        self.membership: Membership = attempt.membership
        self.members: list[int] = []  # the ranks of the current process group, in group-rank order
        self.source: int | None = None  # after a loss: the survivor whose state the others take
        self.joining: dict[int, Any] = {}  # rank -> the handle of its start-up (`WorkerGroup.start_joiner`)
        self.changes: list[dict[str, Any]] = []  # membership events since the last re-form
        self.drains: list[dict[str, Any]] = []  # draining nodes waiting for a step boundary
        self.left: set[int] = set()  # members of the block just ended that left with it (`_end_block`)
        # Workers a membership slot holds: 1, or under --fsdp D a replica's D (ranks slot x D + d), which
        # leave and join together (strategies/elastic_cut.py); MIN and MAX count replicas.
        self.per = attempt.config.replica_size
        self.cut: set[int] = set()  # the block out now: live workers of a replica with a lost one, ended (`cut_loose`)

    def begin(self) -> None:
        """The phase's first process group, of the members it starts with."""
        self._reform("start")

    def poll(self, stopping: bool = False) -> list[int]:
        """The loop's turn for the policy: once the block out is whole, its books (`_end_block`); once
        the boundary's evaluations and checkpoints are back too, the boundary: a draining node's
        checkpoint and leaves, joiners taken in (the group is re-formed for them before the next block,
        after the loop's --chaos strike). Joiners are timed from their admission by the re-form, so
        nothing is returned. Blocks go on after a callback's stop (the step dealt last is finished)."""
        dispatch = self.dispatch
        if dispatch.block and not dispatch.back():
            return []
        if dispatch.block:
            self._end_block()
        if dispatch.pending or dispatch.turn_taken or self.plan.finished:
            return []
        self._preempted()
        self._join()
        dispatch.to_step_boundary = bool(self.drains)  # a draining node waits for a step boundary (its checkpoint)
        dispatch.turn_taken = True
        return []

    def settle(self) -> None:
        """Re-form the group if the membership changed since the last one (before anyone reads the model)."""
        if self.changes:
            self._reform("resize")

    def fed(self, rank: int) -> None:
        """A segment goes to `rank`: nothing to do (members change only at boundaries)."""

    def drained(self) -> None:
        """Nothing between results: a draining node's members leave at a boundary (`poll`)."""

    # ------------------------------------------------------------------ a block's end
    def _end_block(self) -> None:
        """The block is whole: record the rows of the rounds that stand, the members lost in it leave
        (through the loop's failure policy), the survivors agree again, then the boundary's
        evaluations and checkpoints go out."""
        a, loop = self.a, self.loop
        end = self.dispatch.close()
        self.cut = set()
        for rows in end.rows.values():
            if rows["step"]:
                a.record_rows(rows)
                # The detector and --balance speed's balancer measure the members from these rows (without
                # this a range's balancer never had a row, and its shares stayed where the re-forms put them).
                a.watch_stragglers(rows)
                loop.last_loss = rows["loss"][-1]
        if end.redo:
            self.membership.samples_redone += len(end.redo) * self.config.unit_samples
        if end.lost or end.redo:
            self.lost(end.lost, end.redo, end.without_row, end.source)
        self.settle()  # a member lost: the survivors agree again before anyone reads the model
        a.steps_done = a.state.steps_done = self.plan.steps_done
        a.progress(end.epoch, a.total_steps, loop.last_loss, loop.last_metrics)
        self.dispatch.at_boundary(end.finished)

    # ------------------------------------------------------------------ losses
    def cut_loose(self) -> None:
        """A cut replica (--fsdp D, --tensor-parallel T) that lost a worker in the block out now finishes no
        more rounds, and leaves whole at the block's end (`_leave`). Its live workers come back from the
        block at once (their collectives with the lost one fail on its closed connections), but their
        processes would keep the other replicas' collectives with them open until --collective-timeout-s
        (300 s by default). So each is ended as soon as it is back and its replica has a loss: those
        collectives then fail at once too. Only the process: the books (members, events, the rows it
        returned) are the block end's, as before."""
        if self.per == 1:
            return
        broken = {rank - rank % self.per for rank in self.dispatch.lost}
        for rank in self.dispatch.results:
            if rank - rank % self.per in broken and rank not in self.cut:
                self.group.end_process(rank)
                self.cut.add(rank)

    def lost(
        self, lost: dict[int, RunLost], redo: list[Unit], without_row: dict[int, list[Unit]], source: int | None
    ) -> None:
        """A block broke: members in `lost` are gone; each leaves (its event recorded, whatever the
        policy then says), and the loop's failure policy decides on the first: a leave while the run
        keeps MIN, else the attempt ends (RunLost). `redo`: its abandoned rounds' units, back in the
        plan; `without_row`: each lost member's units applied in rounds that stand; `source`: a
        survivor at the round that stands, whose state the others take at the re-form."""
        self.source = source
        for i, (rank, gone) in enumerate(sorted(lost.items())):  # the abandoned rounds' units: on the first
            self._leave(rank, leave_cause(gone), gone, redo if i == 0 else [], without_row.get(rank, []))
        if lost:  # the policy decides on the first (a peer's failure names no rank: this call's)
            rank, gone = next(iter(lost.items()))
            self.left = set(lost)
            try:
                self.loop.lose(gone if gone.target == rank else RunLost(gone.kind, rank, gone.detail), rank)
            finally:
                self.left = set()
        else:  # a broken group with everyone still here (a timeout): re-form all the same
            self.changes.append({"cause": "group broken"})

    def situation(self, lost: RunLost) -> Situation:
        """What the failure policy needs to know of the membership to decide on `lost`: the run's size
        with it (a member of the block just ended has left already)."""
        members = self.a.members()
        gone = lost.target in self.left
        return Situation(elastic_min=self.config.workers, members=len(members) // self.per + gone, member=True)

    def leave(self, lost: RunLost) -> None:
        """The failure policy's LEAVE for `lost`: a member of the block just ended left with it
        (`lost`); one lost between blocks (its evaluation or checkpoint call) leaves now, its calls go to
        another member. The group re-forms without it before the next block."""
        rank = lost.target
        assert rank is not None
        if rank in self.left:
            return
        calls = self.dispatch.take(rank)
        self.group.discard([handle for handle, _ in calls], min(10.0, self.config.collective_timeout_s))
        self._leave(rank, leave_cause(lost), lost, [], [])
        self.dispatch.members = [r for r in self.dispatch.members if r != rank]
        for _, (kind, _, payload) in calls:
            self.dispatch.call(kind, self.dispatch.members[0], payload)

    def _leaves(self, lost: RunLost, members: int) -> bool:
        """The failure policy's word on `lost` (`members`: the run's size with it): a leave, or a failure."""
        situation = Situation(elastic_min=self.config.workers, members=members, member=True)
        return self.a.decide(lost, situation=situation).action == LEAVES

    def _leave(self, rank: int, cause: str, lost: RunLost | None, redo: list[Unit], without_row: list[Unit]) -> None:
        """`rank` leaves, and with it the rest of its replica under --fsdp D (one event each; the
        slot's group is given back once)."""
        a = self.a
        if rank not in a.members():  # left already, with a replica mate lost in the same block
            return
        a.machine.to(Stage.RESIZING)
        first = rank - rank % self.per
        mates = [r for r in range(first, first + self.per) if r != rank and r in a.members()]
        for r in [rank, *mates]:
            self.group.kill(r)
        self.membership.renew(rank)
        for r in [rank, *mates]:
            why = cause if r == rank else f"replica of {rank} left ({cause})"
            members = len(a.members())
            units = len(redo) if r == rank else 0
            event = self.membership.record(LEAVE, r, why, members, a.steps_done, a.now(), a.emit, units)
            if lost is not None and r == rank:
                event["detail"] = lost.detail
            event["units_without_row"] = [list(u) for u in without_row] if r == rank else []
            self.changes.append(event)

    # ------------------------------------------------------------------ joins and drains
    def _join(self) -> None:
        """Start a worker in each newly placed slot; a built one joins at this boundary."""
        a, group = self.a, self.group
        for rank in self.membership.joinable(a.members()):
            if rank not in self.joining:
                self.joining[rank] = group.start_joiner(rank)
        for first in sorted({rank - rank % self.per for rank in self.joining}):
            ranks = list(range(first, first + self.per))  # a replica's workers join together, once all are built
            if any(r not in self.joining for r in ranks):
                continue
            handles = [self.joining[r] for r in ranks]
            if len(group.wait(handles, 0, num_returns=len(handles))) < len(handles):
                continue
            phase = a.phase_config or a.config
            admitted = []
            for r, handle in zip(ranks, handles, strict=True):
                del self.joining[r]
                if group.admit(r, handle, phase, self.config.collective_timeout_s):
                    admitted.append(r)
            if len(admitted) < len(ranks):  # one died being built (its node went): ask for room again
                for r in admitted:
                    group.kill(r)
                self.membership.renew(first)
                continue
            a.machine.to(Stage.RESIZING)
            for r in ranks:
                members = len(a.members())
                self.changes.append(self.membership.record(JOIN, r, "placed", members, a.steps_done, a.now(), a.emit))

    def _preempted(self) -> None:
        """A draining node: checkpoint at the next step boundary, then its members leave."""
        for node, ranks in self.membership.draining(self.a.members()).items():
            if ranks:
                self.drains.append({"node": node, "ranks": ranks})
        if not self.drains or not self.plan.aligned:
            return
        a = self.a
        for drain in self.drains:
            ranks = [r for r in drain["ranks"] if r in a.members()]
            staying = [r for r in a.members() if r not in ranks]
            entry = {"node": drain["node"], "step": a.steps_done, "path": None, "wall_time": None, "ranks": ranks}
            self.membership.drain_checkpoints.append(entry)
            src = (staying or ranks)[0]
            state = self.group.state(src, self.config.hang_timeout_s)
            epochs = a.steps_done // a.steps_per_epoch
            a.save(step_checkpoint_name(a.steps_done), state, epochs, a.steps_done)  # fills entry's path
            if not ranks or not self._leaves(RunLost("node", ranks[0], "draining"), len(staying) // self.per + 1):
                continue  # leaving would go below MIN: they stay until it goes
            for rank in ranks:
                self._leave(rank, "node draining", None, [], [])
        self.drains = []

    # ------------------------------------------------------------------ the re-form
    def _reform(self, cause: str) -> None:
        """A new process group of the members, the state broadcast from one that trained on."""
        a, group = self.a, self.group
        for _attempt in range(3):
            self._drop_dead()
            members = a.members()
            survivors = [r for r in members if r in self.members]
            source = self.source if self.source in members else (survivors or members)[0]
            address = group.rendezvous_address(members[0])
            t0 = time.monotonic()
            calls = {group.reform(r, address, i, len(members), members.index(source)): r for i, r in enumerate(members)}
            results, failed = {}, {}
            for handle, rank in calls.items():
                try:
                    results[rank] = a.result(handle, rank, self.config.collective_timeout_s + 10)
                except RunLost as gone:  # its actor died, or (target None) its new group could not form
                    if gone.kind == USER_CODE:
                        raise
                    failed[rank] = gone
            if not failed:
                break
            for rank, gone in failed.items():  # died during the re-form: leave; the others form again
                if gone.target == rank:
                    self._leave(rank, leave_cause(gone), gone, [], [])
        else:
            raise next(iter(failed.values()))
        seconds = round(time.monotonic() - t0, 3)
        reform = {
            "cause": cause,
            "step": a.steps_done,
            "units_done": sum(self.plan.units_done.values()),
            "members": members,
            "source": source,
            "before": {str(r): results[r]["before"] for r in members},
            "after": {str(r): results[r]["after"] for r in members},
            "survivors": survivors,
            "seconds": seconds,
        }
        if any("scale" in results[r] for r in members):  # --precision fp16: each member's loss scale, before and after
            reform["scale"] = {str(r): results[r].get("scale") for r in members}
        self.membership.reforms.append(reform)
        if self.changes and "change" in self.changes[-1]:
            self.changes[-1]["setup_s"] = seconds  # the summary's reform_s adds these up
        self.members, self.source, self.changes = members, None, []
        self.dispatch.members = list(members)
        if isinstance(a.balancer, ElasticShareBalancer):  # a joiner at the mean share, a leaver's shared out
            a.balancer.follow(members, a.steps_done)
        a.machine.to(Stage.TRAINING)

    def _drop_dead(self) -> None:
        """Members whose actor is gone (a node lost while its results had come in) leave before the
        re-form, which would otherwise wait --collective-timeout-s for them to join."""
        for rank in self.a.members():
            gone = self.group.probe(rank, self.config.collective_timeout_s)
            if gone is not None:
                self._leave(rank, leave_cause(gone), gone, [], [])
        if len(self.a.members()) // self.per < self.config.workers:
            raise RunLost("worker", None, "below --workers MIN before the re-form")
