"""Elastic membership (`--workers MIN..MAX`) as the controller's scaling policy: between results the
phase loop (orchestrator/controller/loop.py) asks it to take in joiners (a slot whose placement group
got placed), to checkpoint for a draining node and let its members go, and, on a loss, what the
failure policy is to know (`situation`); a LEAVE decision is carried out here (`leave`). The books
(who is in, events, drains) are orchestrator/membership.py's `Membership`.

Under the parameter-server transport the shards must know who is in: the bound of SSP holds among
members, and BSP rounds over the PS (`rounds`) close on the pushes of the members with work
(`in_rounds`), so a member the plan has nothing for leaves the rounds until it is fed again.

Across cut replicas (`--fsdp D` and/or `--tensor-parallel T`, strategies/sharded_ps.py) a member is a
replica of D x T workers (ranks r x D x T .. (r + 1) x D x T - 1, one placement group,
orchestrator/membership.py): they are started, set up (their own group, at worker 0's rendezvous)
and fed together (orchestrator/replica_dispatcher.py),
the shards count the replica as one client (the group maps ranks to it), and a lost worker takes its
whole replica out: its siblings are stopped (their FSDP collectives would wait for it), the segments
not wholly back are handed out again, and the run goes on without a restart. A sibling whose FSDP
collective failed first (gloo on the closed connection) returns its segment broken rather than raising
(strategies/sharded_ps.py `_inside_replica`): the replica leaves all the same, for the mate that is gone
(`broken_replica`), whichever of the two the driver hears of first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.orchestrator import membership as books
from distrain.orchestrator.checkpoint import step_checkpoint_name
from distrain.orchestrator.controller.status import Stage
from distrain.orchestrator.dispatcher import Dispatcher
from distrain.orchestrator.failure_policy import LEAVE, Situation
from distrain.orchestrator.membership import JOIN, Membership, leave_cause
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.replica_dispatcher import ReplicaDispatcher

if TYPE_CHECKING:
    from distrain.orchestrator.controller.attempt import Attempt


class ElasticScaling:
    def __init__(self, attempt: Attempt, dispatch: Dispatcher) -> None:
        assert attempt.membership is not None
        self.a = attempt
        self.membership: Membership = attempt.membership
        self.dispatch = dispatch
        self.in_rounds: set[int] = set()  # BSP over the PS: members the rounds wait for (`_sync_rounds`)
        # Workers a member holds: 1, or across cut replicas D (their worker 0's rank stands for them here).
        self.per = attempt.config.replica_size
        self.replicas: ReplicaDispatcher | None = dispatch if isinstance(dispatch, ReplicaDispatcher) else None

    def begin(self) -> None:
        self.dispatch.elastic, self.dispatch.members = True, self.a.members()
        self.in_rounds = set(self._firsts(self.a.members()))
        self.sync_members(entering=sorted(self.in_rounds))

    def _firsts(self, ranks: list[int]) -> list[int]:
        """The members' worker-0 ranks (each rank itself without cut replicas)."""
        return [r for r in ranks if r % self.per == 0]

    def poll(self, stopping: bool = False) -> list[int]:
        """Between results: a draining node's checkpoint, joiners (returned), idle members out of the
        rounds; nothing once a callback stopped the run (the plan ends at the step handed out last)."""
        if stopping:
            return []
        self._preempted()
        joined = self._join()
        self._leave_rounds_if_idle()
        return joined

    def situation(self, lost: RunLost) -> Situation:
        """What the failure policy needs to know of the membership to decide on `lost`."""
        members = self.a.members()
        count = len(members) // self.per  # MIN counts replicas
        return Situation(elastic_min=self.a.config.workers, members=count, member=lost.target in members)

    # ------------------------------------------------------------------ joins
    def _join(self) -> list[int]:
        """Start a worker in each slot placed since the last look; it is set up against the live shards
        (θ, its clock: nothing from disk), then fed (its calls queue behind the setup)."""
        a = self.a
        joined = self.membership.joinable(a.members())
        if self.per > 1:
            self._join_replicas(joined)
            return joined
        for rank in joined:
            with a.machine.during(Stage.RESIZING):
                a.group.start([rank])
                event = self.membership.record(JOIN, rank, "placed", len(a.members()), a.steps_done, a.now(), a.emit)
                self.in_rounds.add(rank)  # it is fed at once
                self.sync_members(entering=[rank])  # before its setup, which reads its clock from the shards
                self.dispatch.track(a.group.set_up(rank, a.phase_config or a.config), ("setup", rank, event))
                self.dispatch.members = a.members()
                self.dispatch.feed(rank)
        return joined

    def _join_replicas(self, joined: list[int]) -> None:
        """Cut replicas: each placed slot's D x T workers start together, the shards count the replica in, and
        its workers are set up (their group at worker 0's rendezvous; worker (d, t)'s piece from shard
        d x T + t) and fed."""
        a = self.a
        for first in self._firsts(joined):
            ranks = list(range(first, first + self.per))
            with a.machine.during(Stage.RESIZING):
                a.group.start(ranks)
                events = [
                    self.membership.record(JOIN, r, "placed", len(a.members()), a.steps_done, a.now(), a.emit)
                    for r in ranks
                ]
                self.in_rounds.add(first)
                self.sync_members(entering=[first])
                rendezvous = a.group.rendezvous_address(first)
                for r, event in zip(ranks, events, strict=True):
                    self.dispatch.track(a.group.set_up(r, a.phase_config or a.config, rendezvous), ("setup", r, event))
                self.dispatch.members = a.members()
                self.dispatch.feed(first)

    def fed(self, rank: int) -> None:
        """A segment goes to `rank`: BSP over the PS, it enters the rounds at the next boundary."""
        rank -= rank % self.per  # a replica enters as one
        if self.a.transport.ps_mode == "rounds" and rank not in self.in_rounds:
            self.in_rounds.add(rank)
            self.sync_members(entering=[rank])

    # ------------------------------------------------------------------ the shards' view of the members
    def sync_members(self, entering: list[int] | None = None) -> None:
        """Tell the shards who is in (the bound holds among members; a joiner's clock is raised). BSP
        rounds: who each round waits for (`_sync_rounds`); `entering`: ranks that join the rounds."""
        if not self.a.group.has_shards():
            return
        if self.a.transport.ps_mode == "rounds":
            self._sync_rounds(entering or [])
            return
        self.a.group.set_members(self.a.members())

    def _sync_rounds(self, entering: list[int]) -> None:
        """Elastic BSP over the PS: a round closes on its members' pushes, so the shards must know
        who takes part: the members with work (`in_rounds`; one with none would hold every round up:
        at a --chaos hold, at the end of the run). A rank entering goes in at a round boundary every
        shard agrees on: the open round when nobody else is in (nobody has pushed to it), else the one
        after the furthest shard's open round, which cannot close before the rank is in unless a whole
        round passed meanwhile: then a shard refuses and the next boundary is tried."""
        group = self.a.group
        members = sorted(self.in_rounds & set(self.a.members()))
        entering = [r for r in entering if r in members]
        others = [r for r in members if r not in entering]
        for _ in range(100):
            versions = [c["version"] for c in group.shard_counters()]
            start = max(versions) + 1 if others else max(versions)
            if group.set_round_members(members, entering, start):
                return
        raise RunLost("hang", None, "the parameter-server shards' rounds moved on faster than a member could enter")

    def _leave_rounds_if_idle(self) -> None:
        """Elastic BSP over the PS: a member the work plan has nothing for now (the rest of the epoch is
        with others, a --chaos hold, the end) leaves the rounds until it is fed again (`fed`)."""
        if self.a.transport.ps_mode != "rounds":
            return
        busy = self.replicas.replica_in_flight if self.replicas is not None else self.dispatch.in_flight
        idle = {r for r in self.in_rounds if busy(r) == 0}
        if idle:
            self.in_rounds -= idle
            self.sync_members()

    # ------------------------------------------------------------------ leaves
    def leave(self, lost: RunLost, cause: str | None = None) -> None:
        """Worker `lost.target` leaves (the failure policy's LEAVE): its work goes to the others, its
        slot asks for room again."""
        a, dispatch, config = self.a, self.dispatch, self.a.config
        rank = lost.target
        assert rank is not None
        if self.replicas is not None:
            self._leave_replica(lost, cause)
            return
        with a.machine.during(Stage.RESIZING):
            a.group.kill(rank)  # a hung worker must not push again
            lost_calls = dispatch.take(rank)
            a.group.discard([handle for handle, _ in lost_calls], min(10.0, config.collective_timeout_s))
            units_redone = 0
            for _, (kind, _, payload) in lost_calls:
                if kind == "segment":
                    dispatch.work.requeue(payload)
                    units_redone += len(payload)
            a.group.worker_lost(rank, config.hang_timeout_s)  # backup tasks: the portions it held go to the others
            # Its clock goes back to the one of its last segment whose rows came in (as a replacement's:
            # orchestrator/replacement.py), so the shards' books agree with what the driver counted; it
            # is raised again to the members' least when the slot is filled (`ParameterShard.set_members`).
            if a.group.has_shards() and a.confirmed_clock:
                a.group.rebase_clock(rank, a.confirmed_clock[rank])
            self.sync_members()  # whoever waited on its clock goes on
            self.membership.samples_redone += units_redone * config.unit_samples
            self.membership.renew(rank)
            members = len(a.members())
            why = cause or leave_cause(lost)
            event = self.membership.record(books.LEAVE, rank, why, members, a.steps_done, a.now(), a.emit, units_redone)
            event["detail"] = lost.detail
            for _, (kind, _, payload) in lost_calls:  # evaluations and checkpoints: on another member
                if kind in ("eval", "state"):
                    dispatch.call(kind, dispatch.evaluator(), payload)
            dispatch.members = a.members()
            dispatch.feed_all()  # the others take its units now

    def broken_replica(self, rank: int, units: list[tuple[int, int, int]], error: str) -> RunLost:
        """Worker `rank` of a cut replica returned its segment of `units` broken (`GroupBroken`: one of its
        replica's collectives failed). Its rows are dropped, their units handed out again when the replica
        leaves, and what the loop is to take as lost is returned: the mate that is gone (its actor dead,
        which may reach Ray only now, or silent: asked in turn), so the replica leaves as for that
        worker's loss (`_leave_replica`, through the failure policy); with every mate answering, the
        group's timeout passed on a live replica: it leaves as hung, on `rank`."""
        a = self.a
        assert self.replicas is not None
        self.replicas.abandon(rank, units)
        first = rank - rank % self.per
        wait = min(10.0, a.config.collective_timeout_s)
        for mate in range(first, first + self.per):
            if mate != rank and mate in a.members():
                gone = a.group.probe(mate, wait)
                if gone is not None:
                    return gone
        return RunLost("hang", rank, f"its replica's group broke with every worker answering ({error})")

    def _leave_replica(self, lost: RunLost, cause: str | None) -> None:
        """Cut replicas: worker `lost.target` takes its replica out. Its siblings are stopped too (their
        FSDP collectives would wait for it), the replica's segments not wholly back go to the others
        (their held-back rows are dropped: each unit keeps one row), the shards stop counting it, and its
        slot asks for room again."""
        a, config = self.a, self.a.config
        assert self.replicas is not None and lost.target is not None
        rank, first = lost.target, lost.target - lost.target % self.per
        if rank not in a.members():  # gone already, with a sibling lost before it
            return
        ranks = [rank] + [r for r in range(first, first + self.per) if r != rank and r in a.members()]
        with a.machine.during(Stage.RESIZING):
            for r in ranks:
                a.group.kill(r)  # a hung worker must not push again; its siblings would wait on it
            lost_calls, redo = self.replicas.take_replica(first)
            a.group.discard([handle for handle, _ in lost_calls], min(10.0, config.collective_timeout_s))
            if redo:
                self.dispatch.work.requeue(redo)
            # Its clock goes back to that of its last segment whose rows came in, as for a plain worker (the
            # D workers' rows come in together, booked on the last to answer: the freshest of theirs).
            if a.group.has_shards() and a.confirmed_clock:
                a.group.rebase_clock(first, max(a.confirmed_clock[r] for r in range(first, first + self.per)))
            self.in_rounds.discard(first)
            self.sync_members()  # whoever waited on its clock goes on
            self.membership.samples_redone += len(redo) * config.unit_samples * self.per
            self.membership.renew(first)
            why = cause or leave_cause(lost)
            for r in ranks:
                members = len(a.members())
                reason = why if r == rank else f"replica of {rank} left ({why})"
                units = len(redo) if r == rank else 0
                event = self.membership.record(books.LEAVE, r, reason, members, a.steps_done, a.now(), a.emit, units)
                if r == rank:
                    event["detail"] = lost.detail
            self.dispatch.members = a.members()
            for _, (kind, _, payload) in lost_calls:  # evaluations and checkpoints: on another replica
                if kind in ("eval", "state"):  # (made once, on its worker 0: ray_group `_on_replica`)
                    self.dispatch.call(kind, self.dispatch.evaluator(), payload)
            self.dispatch.feed_all()  # the others take its units now

    def _preempted(self) -> None:
        """A node is draining (preemption). Checkpoint now: the state is asked of a member off that node,
        behind its queued segment, and the loop goes on meanwhile (under SSP that segment may wait for
        the very workers about to leave); once it is written (`drained`), they leave."""
        a = self.a
        for node, ranks in self.membership.draining(a.members()).items():
            if not ranks:
                continue
            keep = [r for r in a.members() if r not in ranks] or ranks  # ask one not on the node
            self.dispatch.call("state", keep[0], (step_checkpoint_name(a.steps_done), a.steps_done))
            self.membership.drain_checkpoints.append(
                {"node": node, "step": a.steps_done, "path": None, "wall_time": None, "ranks": ranks}
            )

    def drained(self) -> None:
        """The members of a draining node whose checkpoint is written leave (their slots ask for room
        elsewhere), where the failure policy says so (not below MIN)."""
        for drain in self.membership.drain_checkpoints:
            if drain["path"] is None or drain.get("done"):
                continue
            drain["done"] = True
            for rank in drain["ranks"]:
                if rank not in self.a.members():  # left with a replica mate on the node
                    continue
                lost = RunLost("node", rank, f"node {drain['node'][:8]} is draining")
                if self.a.decide(lost, situation=self.situation(lost)).action == LEAVE:
                    self.leave(lost, cause="node draining")
