"""What the controller asks of its workers and parameter-server shards: the `WorkerGroup` protocol.

The controller (orchestrator/controller/attempt.py) decides; a group carries out. Two implement it:
`RayWorkerGroup` (orchestrator/controller/ray_group.py: actors, placement groups, `ray.wait`,
`ray.kill`) and the tests' plain-Python one (tests/unit/dummy_group.py), which lets the controller be
driven through failures, restarts, joins, leaves, chaos events and interrupts without Ray.

A call is made with `submit(kind, rank, payload)` ("segment", "eval", "state"; see
orchestrator/dispatcher.py) and returns a handle; `wait` says which handles are ready; `result` gives
a handle's value or raises `RunLost` (orchestrator/recovery.py) for a lost actor, with kind
`USER_CODE` and the worker's error as its `__cause__` when the worker's own code raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from distrain.config import RunConfig
from distrain.orchestrator.chaos import ChaosMonkey
from distrain.trainers.optim_state import FlatOptimizerState

if TYPE_CHECKING:
    from distrain.orchestrator.recovery import RunLost


@dataclass
class PhaseSetup:
    """What a phase's transport looks like to the controller once it is set up."""

    ps_mode: str | None = None  # the shards' consistency rule's mode ("rounds", "bounded", ...); None: no shards
    clocks: list[int] = field(default_factory=list)  # each worker's clock on the shards
    step_offset: int = 0  # global step minus the shards' round number


class WorkerGroup(Protocol):
    # ------------------------------------------------------------------ workers
    def members(self) -> list[int]:
        """Ranks with a worker now (every rank of a fixed-size run)."""

    def start(self, ranks: list[int]) -> None:
        """Start a worker in each of `ranks` (in its placement slot)."""

    def describe(self, ranks: list[int], timeout: float) -> list[dict[str, Any]]:
        """Each worker's facts once it is up (steps_per_epoch, num_params, node_id), in `ranks` order."""

    def load_state(
        self, ranks: list[int], state: dict[str, Any], timeout: float, per_rank: dict[int, dict[str, Any]] | None = None
    ) -> None:
        """Load a restore point's (or a phase switch's) state into each of `ranks`, with `per_rank[rank]`'s
        entries added for that rank (its own codec state: orchestrator/channel_checkpoint.py)."""

    def enter_phase(
        self,
        phase: RunConfig,
        optimizer: FlatOptimizerState | None,
        counters: dict[str, Any] | None,
        start_step: int,
        steps_per_epoch: int,
    ) -> PhaseSetup:
        """Set a phase's strategy up on every member: driver-side actors (shards, schedulers) first,
        started from the first member's θ and `optimizer`, the shards' `counters` when a run goes on."""

    def leave_phase(self, timeout: float) -> None:
        """Between phases: every worker leaves its transport; the phase's driver-side actors go."""

    def state(self, rank: int, timeout: float | None) -> dict[str, Any]:
        """Worker `rank`'s state to checkpoint (a PS snapshot under the PS), now."""

    def save_shards(self, ranks: list[int], step: int, timeout: float | None) -> bool:
        """Every one of `ranks` begins writing its shards of the state now, after `step` steps (sharded
        replicas, whose workers write their own checkpoints); whether every worker's parameters were finite."""

    def channel_state(self, rank: int, timeout: float | None) -> dict[str, Any]:
        """Worker `rank`'s codec state now (orchestrator/channel_checkpoint.py; empty without a codec)."""

    def submit(
        self,
        kind: str,
        rank: int,
        payload: Any,
        whole_test_set: bool = False,
        shares: tuple[int, ...] | None = None,
        splits: tuple[str, ...] = ("val",),
    ) -> Any:
        """Make a call on worker `rank`; the handle `wait` and `result` take. `shares`: a segment's
        workers' samples per step (--balance speed), where the driver sets them; an evaluation scores `splits`."""

    def wait(self, handles: list[Any], timeout: float, num_returns: int = 1) -> list[Any]:
        """Handles among `handles` whose result is in: up to `num_returns`, once that many are (or
        `timeout` passed)."""

    def result(self, handle: Any, rank: int, timeout: float | None = None) -> Any:
        """The call's value, or RunLost."""

    def discard(self, handles: list[Any], timeout: float) -> None:
        """Read and drop results nobody needs (a lost worker's queued calls)."""

    def kill(self, rank: int) -> None:
        """End worker `rank` (dead, hung or leaving); its slot is empty after."""

    def end_process(self, rank: int) -> None:
        """End worker `rank`'s process, keeping its slot (it leaves later, through `kill`): its open
        connections close, so the collectives of peers waiting on it fail at once."""

    def set_up(self, rank: int, phase: RunConfig, rendezvous: str = "") -> Any:
        """Set a worker started during a phase (a replacement, a joiner) up against the live shards;
        the handle of that call, which the loop waits on with the others. `rendezvous`: the address of
        its replica's FSDP group (a range across cut replicas over the PS), else none."""

    def host_alive(self, rank: int | None) -> bool:
        """Whether `rank`'s placement is on a live node (a replacement can start there)."""

    # ------------------------------------------------------------------ a collective group re-formed (elastic)
    # Under the collective transport a membership change means a new process group
    # (orchestrator/controller/collective_scaling.py): joiners are built outside the group, and at a block
    # boundary every member joins a fresh rendezvous and takes the whole state from one source.
    def start_joiner(self, rank: int) -> Any:
        """Start a worker in slot `rank` that is not a member yet; the handle of its start-up, which
        `wait` (timeout 0) says is in once the worker is built."""

    def admit(self, rank: int, handle: Any, phase: RunConfig, timeout: float) -> bool:
        """The joiner `rank` whose start-up `handle` is in: set it up for `phase` outside any group and
        make it a member; False (no member, nothing raised) when it died being built."""

    def rendezvous_address(self, rank: int) -> str:
        """A fresh rendezvous address hosted by member `rank` (the new group's rank 0)."""

    def reform(self, rank: int, address: str, index: int, size: int, source: int) -> Any:
        """Member `rank` joins the group at `address` as group rank `index` of `size` and takes the state
        broadcast from group rank `source`; the handle's result: {"before", "after": the parameters'
        digest, "seconds"}."""

    def probe(self, rank: int, timeout: float) -> RunLost | None:
        """Whether member `rank` still answers (before a re-form, which would wait for a dead one):
        None, or what it is (`RunLost` "worker" with Ray's error as its cause, or "hang")."""

    # ------------------------------------------------------------------ shards and driver-side actors
    def has_shards(self) -> bool: ...

    def shard_counters(self) -> list[dict[str, Any]]:
        """Every shard's version and clocks; RunLost when one is dead or silent."""

    def rebase_clock(self, rank: int, clock: int) -> None: ...

    def set_members(self, members: list[int]) -> None: ...

    def set_round_members(self, members: list[int], entering: list[int], start: int) -> bool:
        """BSP rounds over the PS: who each round waits for from round `start`; False if a shard refused."""

    def worker_lost(self, rank: int, timeout: float) -> None:
        """The driver-side actors that take the notice (backup tasks' scheduler, Sandblaster's coordinator)
        hand `rank`'s portions out again."""

    def mark_slow(self, ranks: list[int]) -> None: ...

    def strike(self, chaos: ChaosMonkey, steps_done: int) -> None:
        """Inject the --chaos faults due at `steps_done`."""

    # ------------------------------------------------------------------ the end
    def actor_figures(self, config: RunConfig) -> dict[str, Any] | None:
        """The strategy's figures from its driver-side actors (`Strategy.actor_figures`); None when
        they cannot answer (a failed run's actors may be gone)."""

    def shard_nodes(self) -> list[str]: ...

    def shutdown(self) -> None:
        """Leave the transports cleanly after a completed run."""

    def kill_all(self) -> None:
        """End every actor of the attempt (a failure ends it)."""

    def restart(self) -> None:
        """A fresh placement for the next attempt (after a node loss the old one may be unplaceable)."""
