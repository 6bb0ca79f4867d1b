"""`RayWorkerGroup`: the `WorkerGroup` (orchestrator/controller/group.py) of Ray actors.

It owns everything of a run attempt that is Ray's: the `TrainWorker` actors (one per rank, in its
placement-group bundle; an elastic run's only in the slots placed), the driver-side actors a strategy
declares (`Strategy.driver_actors`: specs, strategies/driver_actor.py, started here generically in the
order given and handed to the workers by name), `ray.wait`, `ray.get` with a lost actor turned into
`RunLost`, and `ray.kill`. Of those actors it knows one by name: the PS shards (`PS_SHARDS`), the
transport the controller itself speaks to (clocks, versions, round membership).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distrain.config import RunConfig
from distrain.config.groups_section import worker_cpus
from distrain.errors import DistrainError
from distrain.orchestrator import cluster, streaming, warm_pool
from distrain.orchestrator.chaos import ChaosMonkey
from distrain.orchestrator.controller.group import PhaseSetup
from distrain.orchestrator.failure_policy import USER_CODE
from distrain.orchestrator.recovery import RunLost, classify, discard, kill_all
from distrain.orchestrator.streaming import Streamed
from distrain.orchestrator.tasks import build_task
from distrain.orchestrator.worker import TrainWorker
from distrain.plugins import USER_MODULE_PREFIX, is_lone_module
from distrain.strategies.driver_actor import PS_SHARDS, ActorSetup, DriverActor, checked, start_in_order
from distrain.strategies.strategy_lookup import strategy_class
from distrain.trainers.optim_state import FlatOptimizerState


def get(refs: Any, timeout: float | None = None) -> Any:
    """ray.get that surfaces a worker's user-facing error as itself, not as a remote traceback."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DistrainError):
            raise e.cause from None
        raise


def start_worker(
    config: RunConfig, placement: cluster.Placement, rank: int, run_start: float, warm: bool, data: Any = None
) -> Any:
    """A TrainWorker actor for `rank`, in its placement-group bundle; or, for a run whose workers may be
    kept warm (orchestrator/warm_pool.py), an idle one on the bundle's node, else a fresh one that asks
    for no CPU and is pinned to that node (the bundle holds the CPU; the actor can outlive the group).
    `data`: the worker's shard of a streamed training set (orchestrator/streaming.py)."""
    node = worker_node(placement, rank) if warm else None
    if node is None:
        return (
            ray.remote(TrainWorker)
            .options(
                num_cpus=worker_cpus(config, rank),
                num_gpus=config.gpus_per_worker,
                scheduling_strategy=placement.worker(rank),
                **worker_env(config),
            )
            .remote(config, rank, run_start, data)
        )
    worker = warm_pool.take(node)
    if worker is not None:
        worker.rebuild.remote(config, rank, run_start, data)  # runs before any later call: calls keep their order
        return worker
    pinned = NodeAffinitySchedulingStrategy(node, soft=False)
    return (
        ray.remote(TrainWorker)
        .options(num_cpus=0, scheduling_strategy=pinned, **worker_env(config))
        .remote(config, rank, run_start, data)
    )


def worker_env(config: RunConfig) -> dict[str, Any]:
    """The worker actor's runtime_env, where it needs one (an actor with a runtime_env of its own gets a
    new process, not one of Ray's ready ones):
    - on a Ray not started as distrain starts one, RAY_worker_niceness=0, so the worker runs at nice 0
      as a torchrun rank does, not at Ray's 15 (`cluster.worker_niceness_env`);
    - --storage: the driver's AWS_* variables (credentials, region, endpoint) in the environment of a
      sharded run's workers, which copy their checkpoint shards there from any node (a Ray started
      earlier, or on another machine, does not have this process's environment). Other workers write
      nothing there."""
    from distrain.orchestrator.storage import aws_environment

    env = cluster.worker_niceness_env()
    if config.storage and config.sharded:
        env |= aws_environment()
    return {"runtime_env": {"env_vars": env}} if env else {}


def worker_node(placement: cluster.Placement, rank: int) -> str | None:
    """The node id of worker `rank`'s bundle (None: an elastic run's slot not placed)."""
    node_of = getattr(placement, "node_of", None)  # an elastic run's ElasticPlacement: one group per slot
    return node_of(rank) if node_of is not None else placement.worker_node(rank)


def launch_actor(spec: DriverActor, setup: ActorSetup) -> Any:
    """A driver-side actor of `spec`'s class, with its Ray options (no placement: it holds no CPU by default)."""
    module = inspect.getmodule(spec.actor)
    if module is not None and (module.__name__.startswith(USER_MODULE_PREFIX) or is_lone_module(module)):
        # A plugin file's class: its module exists under that name only in this process (plugins.py), so
        # the actor's process could not import it; the class travels by value instead.
        ray.cloudpickle.register_pickle_by_value(module)
    options = {"num_cpus": spec.num_cpus, "max_concurrency": spec.concurrency(setup.workers)}
    return ray.remote(spec.actor).options(**options).remote(**spec.args(setup))


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
        warm: bool = False,
        stream: Streamed | None = None,
    ) -> None:
        self.config = config
        self.warm = warm  # workers kept warm after a completed run (orchestrator/warm_pool.py)
        self.stream = stream  # the task's Ray Dataset to train on, split afresh for each attempt (streaming.py)
        self.placement = placement
        self.run_start = run_start
        self.actors = actors  # everything started, killed on the way out (run_training's list)
        self.on_started = on_started  # (workers up, workers) as they come up
        self.workers: list[Any] = [None] * config.num_worker_actors
        # The phase's driver-side actors: their specs, handles by spec name, the Ray actors behind them.
        self.driver_specs: tuple[DriverActor, ...] = ()
        self.driver: dict[str, Any] = {}
        self.driver_processes: list[Any] = []
        self.joining: dict[int, Any] = {}  # elastic collective: slot -> a worker being built, not a member yet
        self.side_calls: list[Any] = []  # elastic across cut replicas: replica mates' evaluations and states
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
        shards: list[Any] = [None] * self.config.num_worker_actors
        if self.stream is not None:  # only whole attempts stream (streaming.refusal): a new split for all
            assert sorted(ranks) == list(range(len(shards))), f"a streamed run starts every worker, not {ranks}"
            shards = streaming.shards(self.stream, self.config, cluster.cpus_needed(self.config))
        for rank in ranks:
            self.workers[rank] = start_worker(
                self.config, self.placement, rank, self.run_start, self.warm, shards[rank]
            )
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
        specs = checked(phase.strategy, declared.driver_actors(phase))  # what the strategy needs started
        if all(spec.name != PS_SHARDS for spec in specs):
            counters = None  # versions and clocks go on only where there are shards to hold them
        workers = self.config.num_worker_actors
        warm = self.warm and warm_pool.shards_apply(self.config.elastic)
        setup = ActorSetup(
            phase,
            workers,
            start_step,
            steps_per_epoch,
            optimizer,
            counters,
            started=self.driver,
            params=lambda: self._first_params(timeout),
            param_shapes=lambda: self.result(self.workers[self.members()[0]].param_shapes.remote(), 0, timeout),
            param_cut_dims=lambda tp: self.result(
                self.workers[self.members()[0]].param_cut_dims.remote(tp), 0, timeout
            ),
            # A warm run's shards ask for no CPU: each goes in a bundle that holds its CPUs (cluster.Placement).
            shard_slots=lambda count: self.placement.shards(workers, count, phase.cpus_per_shard if warm else 0.0),
            task_builder=build_task,
            pool=warm_pool if warm else None,
        )
        self._start_driver_actors(specs, setup)
        first = self.workers[self.members()[0]]  # an elastic run's slot 0 may have no worker
        # A cut replica's workers form an FSDP group, on the PS transport too (strategies/sharded_ps.py);
        # under a range, each replica its own, at its worker 0's address (replicas come and go).
        grouped = self.shards is None or phase.sharded
        rendezvous = get(first.rendezvous_address.remote()) if grouped and not self._replica_clients else ""
        ranks = self.members()
        if self._replica_clients:
            per = self.config.replica_size
            own = {r: self.rendezvous_address(r) for r in ranks if r % per == 0}
            refs = [self._setup_call(r, own[r - r % per], phase) for r in ranks]
        else:
            refs = [self._setup_call(r, rendezvous, phase) for r in ranks]
        for ref, rank in zip(refs, ranks, strict=True):
            self.result(ref, rank, timeout)
        if self.shards is None:
            return PhaseSetup()
        now = self._shard_call([self.shards.shards[0].counters.remote()])[0]
        rule = impl.ps_rule(phase)
        assert rule is not None, f"{declared.__name__} asks for {PS_SHARDS} but has no consistency rule"
        return PhaseSetup(rule.mode, self._per_actor(now)["clocks"], start_step - now["version"])

    def _per_actor(self, counters: dict[str, Any]) -> dict[str, Any]:
        """A shard's counters with a clock per worker actor: under --fsdp D a shard counts one client per
        replica, whose clock is each of its D x T workers' (ranks are replica-major)."""
        clocks, size = list(counters["clocks"]), self.config.replica_size
        if not self.config.sharded or size == 1:
            return counters
        return counters | {"clocks": [clocks[rank // size] for rank in range(len(clocks) * size)]}

    def _first_params(self, timeout: float) -> Any:
        """The first member's flat θ (the shards start from it)."""
        first = self.members()[0]
        return self.result(self.workers[first].flat_params.remote(), first, timeout)

    def _start_driver_actors(self, specs: tuple[DriverActor, ...], setup: ActorSetup) -> None:
        """Start the phase's driver-side actors in order (`setup.started` is this group's `driver`)."""
        self.driver_specs = specs
        self.driver.clear()
        self.driver_processes = []
        try:
            start_in_order(specs, setup, launch_actor, self._shard_call, self.driver_processes)
        finally:  # watched and killed with the workers, those started before a failure included
            self.actors.extend(self.driver_processes)

    def _setup_call(self, rank: int, rendezvous: str, phase: RunConfig) -> Any:
        """Worker `rank`'s setup for `phase`: the transport's addresses and every driver-side actor's handle."""
        shards, bounds = (self.shards.shards, self.shards.bounds) if self.shards else ([], [])
        return self.workers[rank].setup.remote(rendezvous, shards, bounds, dict(self.driver), phase)

    @property
    def shards(self) -> Any:
        """The phase's PS shards (strategies/ps_shard_group.py's ShardGroup), if it has them."""
        return self.driver.get(PS_SHARDS)

    def leave_phase(self, timeout: float) -> None:
        get([w.shutdown.remote() for w in self.workers], timeout=timeout)
        for actor in self.driver_processes:  # the next phase starts its own
            ray.kill(actor, no_restart=True)
        self.driver.clear()
        self.driver_specs, self.driver_processes = (), []

    def state(self, rank: int, timeout: float | None) -> dict[str, Any]:
        first = self._replica_first(rank)
        return self.result(self._on_replica(rank, lambda w: w.state.remote()), first, timeout)

    def _replica_first(self, rank: int) -> int:
        """Worker d = 0 of `rank`'s replica under a range across cut replicas (`_on_replica`), else `rank`."""
        per = self.config.replica_size if self.config.elastic else 1
        return rank - rank % per

    def _on_replica(self, rank: int, call: Any) -> Any:
        """`call(worker)` on `rank`, or, elastic across cut replicas (strategies/elastic_cut.py), on
        each of its replica's D workers (an evaluation or a gathered state is a collective inside the
        replica): worker d = 0's answer is the replica's. The others' calls are kept, read later
        (`_settle_side_calls`), so a failure among them is dropped quietly rather than reported by Ray."""
        first = self._replica_first(rank)
        per = self.config.replica_size if self.config.elastic else 1
        if per == 1:
            return call(self.workers[rank])
        refs = [call(self.workers[r]) for r in range(first, first + per)]
        self._settle_side_calls()
        self.side_calls += refs[1:]
        return refs[0]

    def _settle_side_calls(self) -> None:
        if self.side_calls:
            done, self.side_calls = ray.wait(self.side_calls, num_returns=len(self.side_calls), timeout=0)
            discard(done, 0)

    def save_shards(self, ranks: list[int], step: int, timeout: float | None) -> bool:
        refs = [self.workers[r].save_shards.remote(step) for r in ranks]
        return all([self.result(ref, rank, timeout) for ref, rank in zip(refs, ranks, strict=True)])

    def channel_state(self, rank: int, timeout: float | None) -> dict[str, Any]:
        return self.result(self.workers[rank].channel_state.remote(), rank, timeout)

    def submit(
        self,
        kind: str,
        rank: int,
        payload: Any,
        whole_test_set: bool = False,
        shares: tuple[int, ...] | None = None,
        splits: tuple[str, ...] = ("val",),
    ) -> Any:
        worker = self.workers[rank]
        if kind == "segment":
            return worker.run_segment.remote(payload, None if shares is None else list(shares))
        if kind == "eval":
            shard, shards = (0, 1) if whole_test_set else (rank, len(self.workers))
            return self._on_replica(rank, lambda w: w.evaluate.remote(shard, shards, splits))
        assert kind == "state", kind
        return self._on_replica(rank, lambda w: w.state.remote())

    def wait(self, handles: list[Any], timeout: float, num_returns: int = 1) -> list[Any]:
        ready, _ = ray.wait(handles, num_returns=num_returns, timeout=timeout)
        return ready

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

    def end_process(self, rank: int) -> None:
        ray.kill(self.workers[rank], no_restart=True)

    def set_up(self, rank: int, phase: RunConfig, rendezvous: str = "") -> Any:
        assert self.shards is not None
        return self._setup_call(rank, rendezvous, phase)

    @property
    def _replica_clients(self) -> bool:
        """A range across cut replicas over the PS (strategies/sharded_ps.py): the shards count a client per
        replica, so the driver's worker ranks are told them as replicas (`_client`)."""
        return self.config.elastic and self.config.sharded and self.config.transport == "ps"

    def _client(self, rank: int) -> int:
        return rank // self.config.replica_size if self._replica_clients else rank

    def _clients(self, ranks: list[int]) -> list[int]:
        return sorted({self._client(r) for r in ranks})

    def host_alive(self, rank: int | None) -> bool:
        return bundle_alive(self.placement, rank)

    # ------------------------------------------------------------------ a collective group re-formed (elastic)
    def start_joiner(self, rank: int) -> Any:
        worker = start_worker(self.config, self.placement, rank, self.run_start, self.warm)
        self.actors.append(worker)
        self.joining[rank] = worker
        return worker.describe.remote()

    def admit(self, rank: int, handle: Any, phase: RunConfig, timeout: float) -> bool:
        worker = self.joining.pop(rank)
        try:
            ray.get(handle)
            ray.get(worker.setup.remote("", [], [], dict(self.driver), phase), timeout=timeout)
        except ray.exceptions.RayActorError:  # it died being built (its node went)
            return False
        except ray.exceptions.GetTimeoutError:  # too slow to set up (a loaded node): a failed build, not a crash
            ray.kill(worker, no_restart=True)
            return False
        self.workers[rank] = worker
        return True

    def rendezvous_address(self, rank: int) -> str:
        return self.result(self.workers[rank].rendezvous_address.remote(), rank)

    def reform(self, rank: int, address: str, index: int, size: int, source: int) -> Any:
        return self.workers[rank].reform.remote(address, index, size, source)

    def probe(self, rank: int, timeout: float) -> RunLost | None:
        try:
            ray.get(self.workers[rank].describe.remote(), timeout=timeout)
        except ray.exceptions.RayActorError as e:
            gone = RunLost("worker", rank, type(e).__name__)
            gone.__cause__ = e  # `leave_cause` reads a node's death from it
            return gone
        except ray.exceptions.GetTimeoutError:
            return RunLost("hang", rank, "no answer before the re-form")
        return None

    # ------------------------------------------------------------------ shards and driver-side actors
    def has_shards(self) -> bool:
        return self.shards is not None

    def _shard_call(self, refs: list[Any]) -> list[Any]:
        """ray.get of calls to the shards (or another driver-side actor), where a dead or silent one ends
        the attempt (RunLost)."""
        try:
            return ray.get(refs, timeout=self.config.hang_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RunLost("hang", None, "a parameter-server shard did not answer") from e
        except ray.exceptions.RayActorError as e:
            raise RunLost("shard", None, "a parameter-server shard died") from e

    def shard_counters(self) -> list[dict[str, Any]]:
        assert self.shards is not None
        return [self._per_actor(c) for c in self._shard_call([s.counters.remote() for s in self.shards.shards])]

    def rebase_clock(self, rank: int, clock: int) -> None:
        assert self.shards is not None
        self._shard_call([s.rebase_clock.remote(self._client(rank), clock) for s in self.shards.shards])

    def set_members(self, members: list[int]) -> None:
        assert self.shards is not None
        clients = self._clients(members)
        self._shard_call([s.set_members.remote(clients) for s in self.shards.shards])

    def set_round_members(self, members: list[int], entering: list[int], start: int) -> bool:
        assert self.shards is not None
        clients, coming = self._clients(members), self._clients(entering)
        # Shard 0 first: across cut replicas its referee decides every shard's rounds (strategies/ps_shard.py),
        # so it must know of a change before any other shard acts on it; the others then apply what it decided.
        first, *rest = self.shards.shards
        if not self._shard_call([first.set_round_members.remote(clients, coming, start)])[0]:
            return False
        return all(self._shard_call([s.set_round_members.remote(clients, coming, start) for s in rest]))

    def _listening(self, notice: str) -> list[Any]:
        """The phase's driver-side actors that take `notice` (their spec's `notices`)."""
        return [self.driver[spec.name] for spec in self.driver_specs if notice in spec.notices]

    def worker_lost(self, rank: int, timeout: float) -> None:
        refs = [actor.worker_lost.remote(rank) for actor in self._listening("worker_lost")]
        if refs:
            ray.get(refs, timeout=timeout)

    def mark_slow(self, ranks: list[int]) -> None:
        for actor in self._listening("mark_slow"):
            actor.mark_slow.remote(ranks)

    def strike(self, chaos: ChaosMonkey, steps_done: int) -> None:
        chaos.strike(steps_done, self.workers, self.shards.shards if self.shards else [])

    # ------------------------------------------------------------------ the end
    def actor_figures(self, config: RunConfig) -> dict[str, Any] | None:
        try:  # asks the actors (PS shards, scheduler); a failed run's may be gone: the metrics still tell
            return strategy_class(config.strategy).actor_figures(config, dict(self.driver))
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
        """Destroy process groups cleanly after a completed run; a warm group's workers, then its PS shards,
        go to the warm pool, as many as it keeps (those it does not keep are killed on the way out, as always)."""
        live = [w for w in self.workers if w is not None]
        try:
            if not self.warm:
                ray.get([w.shutdown.remote() for w in live], timeout=10)
                return
            nodes = ray.get([w.retire.remote() for w in live], timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            return
        for worker in warm_pool.keep(live, nodes):
            self.actors.remove(worker)
        for shard in self.shards.keep_warm() if self.shards is not None else []:
            self.actors.remove(shard)

    def kill_all(self) -> None:
        kill_all(self.actors)  # (the books stay until `restart`: a failed run's summary reads them)

    def restart(self) -> None:
        """A fresh placement group: after a node loss the old one may be unplaceable."""
        self.workers = [None] * self.config.num_worker_actors
        self.driver.clear()
        self.driver_specs, self.driver_processes = (), []
        self.joining = {}
        cluster.release(self.placement)
        self.placement = None  # type: ignore[assignment]
        self.placement = cluster.place(self.config)
