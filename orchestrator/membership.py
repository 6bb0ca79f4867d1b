"""Elastic membership (`--workers MIN..MAX`): where each rank may run, who is in the run, who joined or
left and why.

Ranks are slots 0..MAX-1: the parameter-server shards keep a clock per slot, and a step is cut into
MAX slices (config.worker_slots), whoever is there to take them. So the epoch's partition of samples
never changes with the membership; only how many workers share it does.

How the run asks for room: one placement group of one bundle per slot, since a placement group
cannot be resized (`ElasticPlacement`). All MAX are created at the start; the run starts once MIN of
them are placed (--collective-timeout-s at most; the PS shards' own group is reserved before any, so
pending workers never take their room, on the driver's node where they fit: a lost shard restarts
the run), and the others stay *pending*: Ray places each as soon as a node has room (a node added, a
busy one freed), and an autoscaler sees pending groups as demand and adds nodes for them (Ray Train
v2's autoscaling coordinator asks with `request_resources` instead; a pending group asks for exactly
the bundles the run would use, and is taken as soon as it is placed).
The controller loop polls the pending groups (`ready_ranks`, no wait) between results.

- Join (the controller's scaling policy, orchestrator/controller/scaling.py): a worker actor starts
  in the slot's group and is set up against the live shards, which give it θ, the optimizer state's
  home and its clock: nothing is read from disk. Then it is fed units like everyone else.
- Preemption (`draining` below, `ElasticScaling._preempted`): a node the cluster is draining (a spot node
  about to go: `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`, or the autoscaler) is seen
  within --- at most half a second --- of the drain request. The run asks for a checkpoint at once
  (the shards' snapshot, from a member off that node, behind its queued segment, while the loop goes
  on), and once it is written (`ElasticScaling.drained`) the members on that node leave as below (cause
  "node draining"); their slots' new groups are not placed on a draining node. Where leaving would take the
  run below MIN, they stay until the node goes, and the failure path restarts from that checkpoint.
- Leave (`ElasticScaling.leave`): a lost worker (dead, hung, its node removed or drained) that the
  failure policy lets leave (orchestrator/failure_policy.py: the run stays at MIN or above without
  it). Its queued calls are taken back: its segments' units go back to the shared work queue and
  are redone by whoever is free (each unit keeps exactly one metrics row), its evaluation or checkpoint
  call goes to another member. Its slot gets a fresh pending group, so it joins again once placed. A
  leave is not a failure: --max-failures counts only losses that would take the run below MIN, which
  the policy decides as in a fixed-size run.

Under the collective transport (BSP, local SGD) the same placement and books are used, but the loop
runs in blocks (orchestrator/controller/collective_scaling.py, its scaling policy): members change only
at a boundary all of them share, where the process group is re-formed from their in-memory state
(`reforms`).

Everything that happened is kept in `events` (summary.json's `membership`) and emitted as
`MembershipChanged` for the display.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distrain.config import RunConfig, format_workers
from distrain.errors import ResourceError
from distrain.orchestrator import failure_policy
from distrain.orchestrator.failure_policy import LedgerView, Situation, decide
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.trial_resources import num_shards

JOIN, LEAVE = "join", "leave"


@dataclass
class MembershipChanged:
    """A worker joined or left an elastic run: `members` is the count after the change."""

    step: int
    change: str  # JOIN or LEAVE
    rank: int
    cause: str  # "placed" (its group became ready), "start", "worker lost", "node lost", "node draining", ...
    members: int
    units_redone: int = 0  # a leaver's units handed out again


@dataclass
class ElasticPlacement:
    """One placement group per slot (module docstring): a slot is a replica, of one worker's bundle, or
    under --fsdp D of D bundles (its D workers are ranks slot x D + d, placed and given back together)."""

    config: RunConfig
    groups: list[PlacementGroup | None] = field(default_factory=list)
    ready: list[Any] = field(default_factory=list)  # each slot's pg.ready() reference
    owned: bool = True  # released at the run's end (cluster.release)
    group: Any = None  # no group of all the workers (cluster.bundle_alive then answers False)
    first_worker: int = 0
    shard_group: PlacementGroup | None = None  # the PS shards', reserved first (pending workers never starve them)

    def __post_init__(self) -> None:
        self.per = self.config.replica_size  # workers (bundles) a slot's group holds
        slots = self.config.worker_slots
        self.groups, self.ready = [None] * slots, [None] * slots
        count = num_shards(self.config)
        if count:
            self.shard_group = _shard_group(count, self.config.cpus_per_shard)
            try:
                ray.get(self.shard_group.ready(), timeout=self.config.collective_timeout_s)
            except ray.exceptions.GetTimeoutError:
                self.release()
                raise ResourceError(
                    f"could not place the {count} parameter-server shard(s) within "
                    f"{self.config.collective_timeout_s:.0f}s; the cluster is busy or too small"
                ) from None
        for rank in range(slots):
            self.ask(rank)

    def ask(self, slot: int) -> None:
        """A fresh pending group for `slot` (a bundle of the worker's resources per worker of the replica)."""
        bundle = {"CPU": self.config.cpus_per_worker}
        if self.config.gpus_per_worker > 0:
            bundle["GPU"] = self.config.gpus_per_worker
        pg = placement_group([bundle] * self.per, strategy="PACK")
        self.groups[slot], self.ready[slot] = pg, pg.ready()

    def renew(self, rank: int) -> None:
        """`rank` left (with its replica's other workers): give its slot's group back and ask for a new
        one (placed wherever there is room)."""
        slot = rank // self.per
        self._remove(slot)
        self.ask(slot)

    def wait_for_min(self, timeout_s: float) -> list[int]:
        """Block until MIN slots are placed; the ranks placed by then. Refused after `timeout_s`."""
        low = self.config.workers
        deadline = time.monotonic() + timeout_s
        while True:
            placed = self.ready_ranks()
            if len(placed) // self.per >= low:
                return placed
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResourceError(
                    f"could place only {len(placed) // self.per} of the MIN {low} replicas of --workers "
                    f"{format_workers(*self.config.worker_range)} within {timeout_s:.0f}s; the cluster is busy or "
                    "too small: lower MIN or add nodes"
                )
            ray.wait([r for r in self.ready if r is not None], num_returns=low, timeout=min(1.0, left))

    def ready_ranks(self) -> list[int]:
        """The worker ranks of the slots whose group is placed now (no waiting)."""
        refs = {ref: slot for slot, ref in enumerate(self.ready) if ref is not None}
        if not refs:
            return []
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return sorted(refs[ref] * self.per + d for ref in done for d in range(self.per))

    def node_of(self, rank: int) -> str | None:
        pg = self.groups[rank // self.per]
        if pg is None:
            return None
        try:
            return placement_group_table(pg)["bundles_to_node_id"].get(rank % self.per)
        except Exception:  # noqa: BLE001 - a group being removed or rescheduled
            return None

    def draining_nodes(self) -> set[str]:
        """The cluster's nodes being drained now (`ray._private.state.state.get_draining_nodes()`, as Ray
        Train v2's PreemptionWatcher polls it)."""
        return set(ray._private.state.state.get_draining_nodes())

    def worker(self, rank: int) -> PlacementGroupSchedulingStrategy:
        slot, bundle = divmod(rank, self.per)
        return PlacementGroupSchedulingStrategy(self.groups[slot], placement_group_bundle_index=bundle)

    def shards(self, workers: int, count: int, hold_cpus: float = 0.0) -> list[Any]:
        """The PS shards go in their own group's bundles (which hold their CPUs: `hold_cpus` has nothing to add)."""
        assert self.shard_group is not None and count <= len(self.shard_group.bundle_specs)
        return [
            PlacementGroupSchedulingStrategy(self.shard_group, placement_group_bundle_index=k) for k in range(count)
        ]

    def _remove(self, slot: int) -> None:
        pg, self.groups[slot], self.ready[slot] = self.groups[slot], None, None
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with the cluster
                pass

    def release(self) -> None:
        for slot in range(len(self.groups)):
            self._remove(slot)
        if self.shard_group is not None:
            try:
                remove_placement_group(self.shard_group)
            except Exception:  # noqa: BLE001 - already gone with the cluster
                pass
            self.shard_group = None


class Membership:
    """The books of an elastic run's membership: who is in, who joined or left and why, drains, re-forms.
    The controller's scaling policy (orchestrator/controller/scaling.py) writes them."""

    def __init__(self, config: RunConfig, placement: ElasticPlacement) -> None:
        self.config = config
        self.placement = placement
        self.events: list[dict[str, Any]] = []
        self.samples_redone = 0
        self.drained: set[str] = set()  # draining nodes already handled
        self._last_drain_poll = 0.0
        self.drain_poll_s = 0.5  # how often `draining` asks the cluster (a test's dummy cluster: every time)
        self.drain_checkpoints: list[dict[str, Any]] = []  # written because a node was draining
        self.reforms: list[dict[str, Any]] = []  # collective transport: each new group (collective_scaling.py)

    def members(self, workers: list[Any]) -> list[int]:
        return [rank for rank, worker in enumerate(workers) if worker is not None]

    def joinable(self, members: list[int]) -> list[int]:
        """Slots placed now that have no worker yet."""
        return [rank for rank in self.placement.ready_ranks() if rank not in members]

    def renew(self, rank: int) -> None:
        """`rank` left: its slot asks for room again (placed wherever there is room)."""
        self.placement.renew(rank)

    def record(
        self,
        change: str,
        rank: int,
        cause: str,
        members: int,
        step: int,
        wall_time: float,
        emit: Callable[[MembershipChanged], None],
        units_redone: int = 0,
    ) -> dict[str, Any]:
        """Book a join or leave (`members`: the count after it) and tell the display."""
        event = {
            "change": change,
            "rank": rank,
            "cause": cause,
            "step": step,
            "wall_time": wall_time,
            "members": members,
            "units_redone": units_redone,
        }
        self.events.append(event)
        emit(MembershipChanged(step, change, rank, cause, members, units_redone))
        return event

    def can_leave(self, workers: list[Any], lost: RunLost) -> bool:
        """Whether `lost` is a leave (the run stays at or above MIN) rather than a failure: the failure
        policy's rule (orchestrator/failure_policy.py), asked with no failure counted."""
        rank = lost.target
        members = self.members(workers)
        situation = Situation(elastic_min=self.config.workers, members=len(members), member=rank in members)
        return decide(lost.loss, LedgerView(0, -1), situation).action == failure_policy.LEAVE

    def draining(self, members: list[int]) -> dict[str, list[int]]:
        """Nodes newly found draining (`ElasticPlacement.draining_nodes`; at most every `drain_poll_s`),
        each with the members running on it."""
        now = time.monotonic()
        if now - self._last_drain_poll < self.drain_poll_s:
            return {}
        self._last_drain_poll = now
        try:
            nodes = self.placement.draining_nodes() - self.drained
        except Exception:  # noqa: BLE001 - a GCS that cannot answer now: look again next time
            return {}
        if not nodes:
            return {}
        self.drained |= nodes
        found: dict[str, list[int]] = {node: [] for node in nodes}
        for rank in members:
            node = self.placement.node_of(rank)
            if node in found:
                found[node].append(rank)
        return found

    def summary(self, members: list[int]) -> dict[str, Any]:
        low, high = self.config.worker_range
        counts = [e["members"] for e in self.events]
        return {
            "workers": format_workers(low, high),
            "min": low,
            "max": high,
            "peak_members": max(counts, default=len(members)),
            "final_members": len(members),
            "joins": sum(1 for e in self.events if e["change"] == JOIN and e["cause"] not in ("start", "restart")),
            "leaves": sum(1 for e in self.events if e["change"] == LEAVE),
            "samples_redone": self.samples_redone,
            "reform_s": round(sum(e.get("setup_s", 0.0) for e in self.events), 3),
            "events": self.events,
            "drain_checkpoints": self.drain_checkpoints,
            "reforms": self.reforms,
        }


def _shard_group(count: int, cpus: float) -> PlacementGroup:
    """The shards' group, on the driver's node when they fit there: an elastic run's members come and
    go with nodes (spot nodes, preempted ones), and a lost shard restarts the whole run, so the shards
    stay where the run is steered from (on a cluster, the head, which is not preempted). Elsewhere,
    packed, when they do not fit."""
    here = ray.get_runtime_context().get_node_id()
    room = next((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["NodeID"] == here and n["Alive"]), 0.0)
    bundles = [{"CPU": cpus}] * count
    if room >= count * cpus:
        return placement_group(bundles, strategy="STRICT_PACK", _soft_target_node_id=here)
    return placement_group(bundles, strategy="PACK")


def leave_cause(lost: RunLost) -> str:
    """Why a worker left, in words; Ray says when an actor died with its node."""
    cause = lost.__cause__
    if lost.kind == "node" or (cause is not None and "node" in str(cause).lower() and "died" in str(cause).lower()):
        return "node lost"
    return {"worker": "worker lost", "hang": "worker hung"}.get(lost.kind, lost.kind)
