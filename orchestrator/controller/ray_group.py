"""`RayWorkerGroup`: the `WorkerGroup` (orchestrator/controller/group.py) of Ray actors.

It owns everything of a run attempt that is Ray's: the `TrainWorker` actors (one per rank, in its
placement-group bundle; an elastic run's only in the slots placed), the driver-side actors a strategy
asks for (`Strategy.driver_actors`: the parameter-server shards, the portion scheduler, Sandblaster's
coordinator), `ray.wait`, `ray.get` with a lost actor turned into `RunLost`, and `ray.kill`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from distrain.config import RunConfig
from distrain.errors import ConfigError, DistrainError
from distrain.orchestrator import cluster
from distrain.orchestrator.chaos import ChaosMonkey
from distrain.orchestrator.controller.group import PhaseSetup
from distrain.orchestrator.failure_policy import USER_CODE
from distrain.orchestrator.portion_scheduler import PortionScheduler
from distrain.orchestrator.recovery import RunLost, classify, discard, kill_all
from distrain.orchestrator.shard_group import ShardGroup
from distrain.orchestrator.worker import TrainWorker
from distrain.strategies.strategy_lookup import strategy_class
from distrain.trainers.optim_state import FlatOptimizerState

# The driver-side actors a strategy may ask for by name (`Strategy.driver_actors`): the parameter-server
# shards (strategies/ps_shard.py, grouped by orchestrator/shard_group.py) and backup tasks' portion scheduler.
# Sandblaster's coordinator (strategies/sandblaster_coordinator.py) reaches the workers in the same slot
# as the portion scheduler: it is the one that hands out their portions.
DRIVER_ACTORS = frozenset({"ps_shards", "portion_scheduler", "sandblaster_coordinator"})


def get(refs: Any, timeout: float | None = None) -> Any:
    """ray.get that surfaces a worker's user-facing error as itself, not as a remote traceback."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DistrainError):
            raise e.cause from None
        raise


def start_worker(config: RunConfig, placement: cluster.Placement, rank: int, run_start: float) -> Any:
    """A TrainWorker actor for `rank`, in its placement-group bundle."""
    return (
        ray.remote(TrainWorker)
        .options(
            num_cpus=config.cpus_per_worker,
            num_gpus=config.gpus_per_worker,
            scheduling_strategy=placement.worker(rank),
        )
        .remote(config, rank, run_start)
    )


def bundle_alive(placement: cluster.Placement, rank: int | None) -> bool:
    """Whether worker `rank`'s placement-group bundle is on a live node (a replacement can start there)."""
    if rank is None:
        return False
    try:
        node = placement.worker_node(rank)
        return any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())
    except Exception:  # noqa: BLE001 - a placement group being rescheduled, a rank it has no bundle for: restart
        return False


class RayWorkerGroup:
    def __init__(
        self,
        config: RunConfig,
        placement: cluster.Placement,
        run_start: float,
        actors: list[Any],
        on_started: Callable[[int, int], None] = lambda started, total: None,
    ) -> None:
        self.config = config
        self.placement = placement
        self.run_start = run_start
        self.actors = actors  # everything started, killed on the way out (run_training's list)
        self.on_started = on_started  # (workers up, workers) as they come up
        self.workers: list[Any] = [None] * config.num_worker_actors
        self.shards: ShardGroup | None = None
        self.portion_scheduler: Any = None  # backup tasks' scheduler, or Sandblaster's coordinator
        self.impl = strategy_class(config.strategy).implementation(config)

    # ------------------------------------------------------------------ workers
    def members(self) -> list[int]:
        return [rank for rank, worker in enumerate(self.workers) if worker is not None]

    def placed_ranks(self) -> list[int]:
        """The ranks a new attempt starts workers in: every one, or an elastic run's slots placed by now."""
        if self.config.elastic:
            return list(self.placement.ready_ranks())  # type: ignore[attr-defined]
        return list(range(self.config.num_worker_actors))

    def start(self, ranks: list[int]) -> None:
        for rank in ranks:
            self.workers[rank] = start_worker(self.config, self.placement, rank, self.run_start)
            self.actors.append(self.workers[rank])

    def describe(self, ranks: list[int], timeout: float) -> list[dict[str, Any]]:
        refs = [self.workers[r].describe.remote() for r in ranks]
        self._report_start_up(refs, timeout)
        return [self.result(ref, rank, timeout) for ref, rank in zip(refs, ranks, strict=True)]

    def _report_start_up(self, refs: list[Any], timeout: float, every_s: float = 1.0) -> None:
        """Report the workers as they come up (at most every `every_s`, and when all are up). Errors
        and timeouts are left to the `result` calls that follow."""
        total, started, last = len(refs), 0, time.monotonic()
        deadline = last + timeout
        self.on_started(0, total)
        pending = list(refs)
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(every_s, deadline - time.monotonic()))
            started += len(ready)
            if ready and (not pending or time.monotonic() - last >= every_s):
                self.on_started(started, total)
                last = time.monotonic()

    def load_state(
        self, ranks: list[int], state: dict[str, Any], timeout: float, per_rank: dict[int, dict[str, Any]] | None = None
    ) -> None:
        refs = [self.workers[r].load_state.remote(state | (per_rank or {}).get(r, {})) for r in ranks]
        for ref, rank in zip(refs, ranks, strict=True):
            self.result(ref, rank, timeout)

    def enter_phase(
        self,
        phase: RunConfig,
        optimizer: FlatOptimizerState | None,
        counters: dict[str, Any] | None,
        start_step: int,
        steps_per_epoch: int,
    ) -> PhaseSetup:
        """Set `phase`'s strategy up on every member; PS shards start from the first member's θ and
        `optimizer`, with the checkpoint's `counters` when the run goes on in the phase it was taken in."""
        timeout = self.config.collective_timeout_s
        declared = strategy_class(phase.strategy)
        self.impl = impl = declared.implementation(phase)
        actors = declared.driver_actors(phase)  # what the strategy needs the driver to start
        unknown = set(actors) - DRIVER_ACTORS
        if unknown:
            raise ConfigError(
                f"--strategy {phase.strategy} asks for unknown driver actors {sorted(unknown)}; "
                f"known: {', '.join(sorted(DRIVER_ACTORS))}"
            )
        rule = impl.ps_rule(phase)
        if "ps_shards" in actors:
            assert rule is not None, f"{declared.__name__} asks for ps_shards but has no consistency rule"
            first = self.members()[0]
            theta = self.result(self.workers[first].flat_params.remote(), first, timeout)
            where = self.placement.shards(self.config.num_worker_actors, phase.ps_shards or 1)
            self.shards = ShardGroup(phase, rule, theta, optimizer, where)
            self.actors.extend(self.shards.shards)
            if counters is not None:  # the shards' versions and clocks go on
                clock = max(counters["clocks"]) if rule.mode == "bounded" else counters["version"]
                clocks = [clock] * self.config.num_worker_actors
                self._shard_call([s.set_counters.remote(counters["version"], clocks) for s in self.shards.shards])
        else:
            counters = None
        if "portion_scheduler" in actors:
            portions = phase.options_of("bsp").portions
            first_tag = counters["version"] if counters is not None else 0  # the shards' version right now
            self.portion_scheduler = (
                ray.remote(PortionScheduler)
                .options(num_cpus=0, max_concurrency=max(64, 4 * len(self.workers)))
                .remote(portions, steps_per_epoch, start_step, first_tag)
            )
            self.actors.append(self.portion_scheduler)
        if "sandblaster_coordinator" in actors:
            from distrain.strategies.sandblaster_coordinator import SandblasterCoordinator

            assert self.shards is not None, "the coordinator drives the parameter-server shards"
            self.portion_scheduler = (
                ray.remote(SandblasterCoordinator)
                .options(num_cpus=0, max_concurrency=max(64, 4 * len(self.workers)))
                .remote(self.shards.shards, start_iteration=start_step, **declared.coordinator_args(phase))
            )
            self._shard_call([self.portion_scheduler.start.remote()])
            self.actors.append(self.portion_scheduler)
        first = self.workers[self.members()[0]]  # an elastic run's slot 0 may have no worker
        rendezvous = "" if "ps_shards" in actors else get(first.rendezvous_address.remote())
        shards, bounds = (self.shards.shards, self.shards.bounds) if self.shards else ([], [])
        ranks = self.members()
        refs = [self.workers[r].setup.remote(rendezvous, shards, bounds, self.portion_scheduler, phase) for r in ranks]
        for ref, rank in zip(refs, ranks, strict=True):
            self.result(ref, rank, timeout)
        if self.shards is None:
            return PhaseSetup()
        now = self._shard_call([self.shards.shards[0].counters.remote()])[0]
        assert rule is not None
        return PhaseSetup(rule.mode, list(now["clocks"]), start_step - now["version"])

    def leave_phase(self, timeout: float) -> None:
        get([w.shutdown.remote() for w in self.workers], timeout=timeout)
        if self.shards is not None:
            for shard in self.shards.shards:
                ray.kill(shard, no_restart=True)
            self.shards = None

    def state(self, rank: int, timeout: float | None) -> dict[str, Any]:
        return self.result(self.workers[rank].state.remote(), rank, timeout)

    def submit(self, kind: str, rank: int, payload: Any, whole_test_set: bool = False) -> Any:
        worker = self.workers[rank]
        if kind == "segment":
            return worker.run_segment.remote(payload)
        if kind == "eval":
            return worker.evaluate.remote(0, 1) if whole_test_set else worker.evaluate.remote(rank, len(self.workers))
        assert kind == "state", kind
        return worker.state.remote()

    def wait(self, handles: list[Any], timeout: float, num_returns: int = 1) -> list[Any]:
        ready, _ = ray.wait(handles, num_returns=num_returns, timeout=timeout)
        return ready

    def rendezvous_address(self, rank: int) -> str:
        """A fresh rendezvous address hosted by worker `rank` (a collective group re-formed around it)."""
        return self.result(self.workers[rank].rendezvous_address.remote(), rank)

    def result(self, handle: Any, rank: int, timeout: float | None = None) -> Any:
        try:
            return get(handle, timeout=timeout)
        except ray.exceptions.RayError as e:
            lost = classify(e, rank, self.config.transport)
            if lost is None:  # the worker's own code raised: the failure policy decides (never retried)
                lost = RunLost(USER_CODE, rank, type(e).__name__)
            raise lost from e

    def discard(self, handles: list[Any], timeout: float) -> None:
        discard(handles, timeout)

    def kill(self, rank: int) -> None:
        ray.kill(self.workers[rank], no_restart=True)  # a hung worker must not push again
        self.workers[rank] = None

    def set_up(self, rank: int, phase: RunConfig) -> Any:
        assert self.shards is not None
        shards, bounds = self.shards.shards, self.shards.bounds
        return self.workers[rank].setup.remote("", shards, bounds, self.portion_scheduler, phase)

    def host_alive(self, rank: int | None) -> bool:
        return bundle_alive(self.placement, rank)

    # ------------------------------------------------------------------ shards and driver-side actors
    def has_shards(self) -> bool:
        return self.shards is not None

    def _shard_call(self, refs: list[Any]) -> list[Any]:
        """ray.get of calls to the shards, where a dead or silent shard ends the attempt (RunLost)."""
        try:
            return ray.get(refs, timeout=self.config.hang_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RunLost("hang", None, "a parameter-server shard did not answer") from e
        except ray.exceptions.RayActorError as e:
            raise RunLost("shard", None, "a parameter-server shard died") from e

    def shard_counters(self) -> list[dict[str, Any]]:
        assert self.shards is not None
        return self._shard_call([s.counters.remote() for s in self.shards.shards])

    def rebase_clock(self, rank: int, clock: int) -> None:
        assert self.shards is not None
        self._shard_call([s.rebase_clock.remote(rank, clock) for s in self.shards.shards])

    def set_members(self, members: list[int]) -> None:
        assert self.shards is not None
        self._shard_call([s.set_members.remote(members) for s in self.shards.shards])

    def set_round_members(self, members: list[int], entering: list[int], start: int) -> bool:
        assert self.shards is not None
        return all(self._shard_call([s.set_round_members.remote(members, entering, start) for s in self.shards.shards]))

    def worker_lost(self, rank: int, timeout: float) -> None:
        if self.portion_scheduler is not None:
            ray.get(self.portion_scheduler.worker_lost.remote(rank), timeout=timeout)

    def mark_slow(self, ranks: list[int]) -> None:
        if self.portion_scheduler is not None:
            self.portion_scheduler.mark_slow.remote(ranks)

    def strike(self, chaos: ChaosMonkey, steps_done: int) -> None:
        chaos.strike(steps_done, self.workers, self.shards.shards if self.shards else [])

    # ------------------------------------------------------------------ the end
    def actor_figures(self, config: RunConfig) -> dict[str, Any] | None:
        actors = {
            "ps_shards": self.shards,
            "portion_scheduler": self.portion_scheduler,
            "sandblaster_coordinator": self.portion_scheduler,
        }
        try:  # asks the actors (PS shards, scheduler); a failed run's may be gone: the metrics still tell
            return strategy_class(config.strategy).actor_figures(
                config, {name: actor for name, actor in actors.items() if actor is not None}
            )
        except ray.exceptions.RayError:
            return None

    def shard_nodes(self) -> list[str]:
        """Where the shards ran; empty if they are gone by now (a node lost as the run ended, as under
        churn: the run is recorded already and must not fail on this question)."""
        try:
            return self.shards.node_ids() if self.shards else []
        except ray.exceptions.RayError:
            return []

    def shutdown(self) -> None:
        """Destroy process groups cleanly after a completed run (the actors are killed afterwards anyway)."""
        try:
            ray.get([w.shutdown.remote() for w in self.workers if w is not None], timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            pass

    def kill_all(self) -> None:
        kill_all(self.actors)  # (the books stay until `restart`: a failed run's summary reads them)

    def restart(self) -> None:
        """A fresh placement group: after a node loss the old one may be unplaceable."""
        self.workers = [None] * self.config.num_worker_actors
        self.shards, self.portion_scheduler = None, None
        cluster.release(self.placement)
        self.placement = None  # type: ignore[assignment]
        self.placement = cluster.place(self.config)
