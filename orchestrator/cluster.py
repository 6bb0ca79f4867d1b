"""Ray connection, resource checks and the workers' placement group."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from distrain.config import RunConfig, groups_section
from distrain.errors import ResourceError
from distrain.orchestrator import (
    address,
    code_shipping,
    interrupts,
    leftovers,
    memory,
    ray_start,
    startup,
    streaming,
    trial_resources,
)


class _DropTokenAuthNotice(logging.Filter):
    """Ray 2.60 announces on every start that token auth is on (the secure default); that notice
    would break the CLI's one-line error output. The warning that auth is *off* still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_DropTokenAuthNotice())


def _dedup_note_follows_color_prefix(colour: Any) -> Any:
    """Ray's log deduplicator colours its "[repeated 2x across cluster]" note whatever RAY_COLOR_PREFIX
    says (ray/_private/ray_logging: `_color`). Where plain text was asked for (a file or a pipe:
    remote_errors.plain_ray_logs_when_piped, or the user's own RAY_COLOR_PREFIX=0), the note is plain too."""

    def note(msg: str) -> str:
        return msg if os.environ.get("RAY_COLOR_PREFIX") == "0" else colour(msg)

    return note


_ray_logging = importlib.import_module("ray._private.ray_logging")
_ray_logging._color = _dedup_note_follows_color_prefix(_ray_logging._color)


SHUTDOWN_GRACE_S = 2.0


@dataclass
class RayConnection:
    started_here: bool
    shipped: list[str] = field(default_factory=list)  # the user's code uploaded to the cluster

    def close(self) -> None:
        if not (self.started_here and ray.is_initialized()):
            return
        with interrupts.deferred():  # a Ray stopped half-way leaves its agents and workers running
            node = _local_node()
            procs = _node_processes(node)
            ray.shutdown()
            # ray.shutdown signals the GCS and raylet and returns; what they started goes with them,
            # mostly: give it a moment, then stop what is left, so nothing outlives the run.
            _, alive = psutil.wait_procs(procs, timeout=SHUTDOWN_GRACE_S)
            leftovers.stop(alive)
            if node is not None:
                leftovers.forget(Path(node.get_session_dir_path()))


def _local_node() -> Any:
    """The Ray node this process started (ray.init without an address), or None."""
    node = getattr(ray._private.worker, "_global_node", None)
    return node if node is not None and node.is_head() else None


def _node_processes(node: Any) -> list[psutil.Process]:
    """The processes `node` started (GCS, raylet, ...) and everything they started (agents, workers)."""
    if node is None:
        return []
    procs = []
    for infos in node.all_processes.values():
        for info in infos:
            try:
                proc = psutil.Process(info.process.pid)
                procs += [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    return procs


def join(ray_address: str, task: str) -> list[str]:
    """ray.init on the existing cluster `--address` names (refused in one line, and quickly, when none
    is there), shipping the user's task code to its nodes (code_shipping); returns what was shipped."""
    found = address.reachable(ray_address)
    shipment = code_shipping.ship(task)
    try:
        with interrupts.deferred():
            ray.init(address=found, runtime_env=shipment.runtime_env, **QUIET)
    except (ConnectionError, RuntimeError) as e:  # something listens there, but it did not let us in
        # Ray 2.60 sends the cluster's token (~/.ray/auth_token) to an explicit address only in token mode.
        auth = "AuthenticationError" in repr(e.__cause__) or "auth" in str(e.__cause__).lower()
        hint = (
            "the cluster wants its token: export RAY_AUTH_MODE=token (the token is read from ~/.ray/auth_token "
            "or RAY_AUTH_TOKEN)"
            if auth
            else f"{found} accepts connections but did not answer as a Ray cluster ({type(e).__name__}); check "
            "the address and port (`ray status` on the head node prints it)"
        )
        raise ResourceError(f"--address {ray_address}: {hint}") from None
    except BaseException:  # interrupted while it connected (raised once it had): leave again
        RayConnection(started_here=True).close()
        raise
    finally:
        shipment.close()  # uploaded by ray.init (or not needed any more)
    return shipment.shipped


# Objects up to this size travel inside the RPC instead of through the shared-memory object store.
# Ray's default (100 KiB) sends every gradient push of a small model (the default cnn: 600 KB)
# through plasma; inlining up to 1 MiB cuts that PS step from 4.6 to 3.2 ms here, while at 4 MB the
# object store is already 2x faster than inlining (benchmarks/RESULTS.md). Applies to clusters
# distrain starts itself.
# `worker_niceness`: Ray renices every worker process to 15 by default (RayConfig, "so that the OS
# prioritizes CPU for other processes over workers"). distrain's workers are the job, and a BSP step
# waits for the slowest of them: at nice 15 any other process on the node (a nice-0 process weighs 28x
# more with the kernel) takes its CPU from the training first, which torchrun's ranks (nice 0) never
# suffer (benchmarks/RESULTS.md, issue 32). On a Ray started elsewhere the worker actors ask for it
# themselves (`worker_niceness_env`).
LOCAL_SYSTEM_CONFIG = {
    "max_direct_call_object_size": 1024 * 1024,
    "task_rpc_inlined_bytes_limit": 64 * 1024 * 1024,
    "worker_niceness": 0,
}
NICENESS_ENV = {"RAY_worker_niceness": "0"}  # read by a worker process's Ray core as it starts


def worker_niceness_env() -> dict[str, str]:
    """The environment a training worker actor needs to run at nice 0 (see LOCAL_SYSTEM_CONFIG): nothing on
    a Ray whose system config says so already (one distrain started, also from a Tune trial's process on it:
    every worker process is at 0 there, Ray's ready ones included); on any other Ray, RAY_worker_niceness=0
    in the actor's runtime_env, so Ray starts a process of its own for it rather than hand it a ready one
    at nice 15."""
    try:
        config = ray._private.state.state.get_system_config()  # the GCS's copy: what the cluster started with
    except Exception:  # noqa: BLE001 - not connected, or a Ray without it: ask for it, it costs only a start
        config = {}
    return {} if config.get("worker_niceness") == 0 else dict(NICENESS_ENV)


QUIET = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)


@contextlib.contextmanager
def ray_processes_in_own_session() -> Iterator[None]:
    """Start the local Ray's processes (GCS, raylet, monitor, log monitor; the raylet's agents and
    workers follow the raylet) in a session of their own, not in the driver's process group.

    A signal sent to the driver's whole group (`kill -TERM -PGID`, `timeout`, a supervisor or a batch
    scheduler stopping a job) would otherwise reach the GCS and raylet too: they die while the driver
    starts its teardown, whose Ray calls then wait 60 s for the dead GCS and end the process with exit
    1. Set apart, only the driver gets the signal, as from `kill PID`, and stops Ray itself. A driver
    killed outright still takes them along: Ray asks the kernel for that (PR_SET_PDEATHSIG), whatever
    the session, and what the raylet started is found by orchestrator/leftovers.py.

    ray.init has no option for this; Ray starts each of these processes through
    `ray._private.services.ConsolePopen` (a subprocess.Popen), looked up at each start, so it is
    replaced for the length of the block. Where a Ray version has no such class, nothing changes."""
    from ray._private import services

    popen = getattr(services, "ConsolePopen", None)
    if popen is None or os.name != "posix":  # pragma: no cover - another Ray layout, or Windows
        yield
        return

    class OwnSessionPopen(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


def start_local_ray(num_cpus: int) -> None:
    """A fresh local Ray (address="local": never a `ray start` cluster found on this machine).

    First stops what is left of local Rays earlier distrain drivers started and never stopped (a
    driver killed with SIGKILL: orchestrator/leftovers.py); marks this one as this driver's."""
    stopped = leftovers.stop_orphaned()
    if stopped:
        logging.getLogger("distrain").warning(
            f"stopped {stopped} Ray process(es) an earlier distrain run left running (its driver was killed)"
        )
    try:
        with interrupts.deferred():  # a Ray start cut short leaves processes no shutdown knows of
            # A copy: Ray writes the session's spilling directory into the dict it is given, and a
            # second fit() in the same process would spill into the first (deleted) session's folder.
            with ray_processes_in_own_session():
                ray.init(address="local", num_cpus=num_cpus, _system_config=dict(LOCAL_SYSTEM_CONFIG), **QUIET)
            node = _local_node()
            if node is not None:
                leftovers.record(Path(node.get_session_dir_path()))
    except BaseException:  # interrupted while it started (raised once it had): stop it again
        RayConnection(started_here=True).close()
        raise


# The local Ray a `distrain.fit` started and keeps for the next fit in this process (as Ray Train's
# `fit` leaves the Ray it started): (its session directory, the connection that stops it at exit).
_kept: tuple[str, RayConnection] | None = None


def local_cpus(config: RunConfig, extra_cpus: int = 0) -> int:
    """The CPUs a local Ray is started with for `config`: at least those the run reserves, so `--workers 4`
    works on a laptop with 2 cores (oversubscribed, as with torchrun), instead of waiting forever."""
    return max(os.cpu_count() or 1, int(-(-cpus_needed(config) // 1)) + extra_cpus)


def start_local_ray_for(config: RunConfig) -> int:
    """Start the local Ray `connect` would start for `config` (orchestrator/ray_start.py's thread runs
    this while the driver loads torch); returns its num_cpus."""
    num_cpus = local_cpus(config)
    start_local_ray(num_cpus)
    return num_cpus


def stop_local_ray() -> None:
    RayConnection(started_here=True).close()


def _session_dir() -> str | None:
    node = _local_node()
    return node.get_session_dir_path() if node is not None else None


def _stop_kept() -> None:
    """Stop the kept Ray (at exit, or for a run it cannot serve), unless the user replaced it since."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None and ray.is_initialized() and _session_dir() == kept[0]:
        kept[1].close()


def connect(config: RunConfig, keep: bool = False, extra_cpus: int = 0) -> RayConnection:
    """Reuse an initialised Ray, connect to `--address`, or start a local Ray sized for the run (and
    `extra_cpus` more: those Ray Data streams on, orchestrator/streaming.py). With `keep` (distrain.fit),
    a local Ray started here stays up for the next run in this process (its warm workers with it:
    orchestrator/warm_pool.py) and stops at exit; a later run it is too small for, or one for `--address`,
    stops it and starts over."""
    global _kept
    if ray_start.pending() and (config.address or extra_cpus):  # not the plain local run it was begun for
        ray_start.discard()
    if _kept is not None and ray.is_initialized() and _session_dir() == _kept[0]:
        if config.address or cpus_needed(config) + extra_cpus > ray.cluster_resources().get("CPU", 0.0):
            _stop_kept()
    if ray.is_initialized() and not ray_start.pending():
        if config.address:  # a dead --address is refused as a fresh process would refuse it
            address.reachable(config.address)
        return RayConnection(started_here=False)
    if config.address:
        # Another node may not have the task's file: ship it (the local Ray below shares this disk).
        return RayConnection(started_here=True, shipped=join(config.address, config.task))
    else:
        num_cpus = local_cpus(config, extra_cpus)
        # Begun by the CLI while it loaded torch (orchestrator/ray_start.py). Taken in a held section, as
        # ray.init runs; then the driver's SIGINT/SIGTERM handlers go back in place: Ray's core worker
        # put its own there (in C++, unseen by Python's records) on the thread that started it.
        with interrupts.deferred():
            taken = ray_start.take(num_cpus)
            interrupts.reassert()
        if not taken:
            started = time.perf_counter()
            start_local_ray(num_cpus)
            startup.ray_started(time.perf_counter() - started, in_background=False)
        session = _session_dir()
        if keep and session is not None:
            # Registered after ray.init's own exit handler, so it runs first (atexit: last in, first out);
            # a second registration of the same function is dropped first.
            atexit.unregister(_stop_kept)
            atexit.register(_stop_kept)
            _kept = (session, RayConnection(started_here=True))
            return RayConnection(started_here=False)  # not this run's to stop
    return RayConnection(started_here=True)


def check_resources(config: RunConfig) -> None:
    """Fail fast, with the fix, when the cluster cannot hold the run's actors at all."""
    total = ray.cluster_resources()
    workers, flags = workers_text(config)
    need_gpus = (config.workers if config.elastic else config.num_worker_actors) * config.gpus_per_worker
    if need_gpus > total.get("GPU", 0.0):
        raise ResourceError(
            f"the run needs {need_gpus:g} GPUs ({workers} x {config.gpus_per_worker:g}) "
            f"but the cluster has {total.get('GPU', 0.0):g}; lower {_or(['--gpus-per-worker', *flags])}, "
            "or add GPU nodes"
        )
    check_custom_resources(config)
    need_cpus = cpus_needed(config)
    if need_cpus > total.get("CPU", 0.0):
        shards = f" + {num_shards(config)} shards x {config.cpus_per_shard:g}" if num_shards(config) else ""
        each = "their groups' CPUs" if groups_section.rank_bundles(config) else f"{config.cpus_per_worker:g}"
        flags = ["--worker-group COUNTs"] if groups_section.rank_bundles(config) else flags
        raise ResourceError(
            f"the run needs {need_cpus:g} CPUs ({workers} x {each}{shards}) "
            f"but the cluster has {total.get('CPU', 0.0):g}; lower {_or(flags)}{',' if len(flags) > 1 else ''} "
            "or the CPUs per actor"
        )


def check_data_cpus(config: RunConfig) -> int:
    """The CPUs left to Ray Data once the run's workers (and shards) hold theirs, for a task's streamed
    training set (orchestrator/streaming.py); refused in one line below `DATA_CPUS`, where
    `streaming_split` would wait forever."""
    total = float(ray.cluster_resources().get("CPU", 0.0))
    held = cpus_needed(config)
    if total - held < streaming.DATA_CPUS:
        workers, flags = workers_text(config)
        raise ResourceError(
            f"Ray Data needs {streaming.DATA_CPUS} CPU the workers do not hold to stream the training set, but the "
            f"cluster has {total:g} and the run's {workers} hold {held:g}; lower --cpus-per-worker or "
            f"{' or '.join(flags)}, or give Ray more CPUs"
        )
    return int(total - held)


def workers_text(config: RunConfig) -> tuple[str, list[str]]:
    """How the resource refusals count the run's worker actors ("4 workers", or a cut replica's grid
    "R x D x T x S = 2 x 2 x 1 x 1 = 4 workers"), and the flags that lower that count: a user who gave
    --fsdp 4 is told of it, not only of --workers."""
    replica = config.replica_size
    workers = config.workers * replica if config.elastic else config.num_worker_actors
    if replica == 1:
        return f"{workers} workers", ["--workers"]
    d, t, s = config.replica_grid
    grid = f"R x D x T x S = {workers // replica} x {d} x {t} x {s} = {workers} workers"
    cut = [f for f, n in (("--fsdp", d), ("--tensor-parallel", t), ("--pipeline-stages", s)) if n > 1]
    backups = ["--backup-workers"] if workers > config.worker_slots * replica else []  # R counts them too
    return grid, ["--workers", *backups, *cut]


def _or(flags: list[str]) -> str:
    return flags[0] if len(flags) == 1 else ", ".join(flags[:-1]) + " or " + flags[-1]


def unused_gpus(config: RunConfig) -> float:
    """The cluster's GPUs when the run asks for none (0 otherwise): worth one line before it starts."""
    return 0.0 if config.uses_gpus else float(ray.cluster_resources().get("GPU", 0.0))


def check_memory(needs: memory.MemoryEstimate) -> None:
    """On a cluster distrain did not start, the estimate against Ray's `memory` resource (what its
    nodes can give tasks and actors). Inside a Tune trial the sweep's sizing stands instead."""
    if get_current_placement_group() is not None:
        return
    override = os.environ.get(memory.AVAILABLE_ENV)
    available = memory.parse_bytes(override) if override else int(ray.cluster_resources().get("memory", 0))
    if available:
        memory.check(needs, available, "the cluster")


num_shards = trial_resources.num_shards


def cpus_needed(config: RunConfig) -> float:
    """CPUs the run cannot start without: an elastic run's MIN replicas (it grows as room appears)."""
    workers = config.workers * config.replica_size if config.elastic else config.num_worker_actors
    groups = groups_section.rank_bundles(config)  # --worker-group: each group's own CPUs per worker
    if groups:
        return sum(b["CPU"] for b in groups) + num_shards(config) * config.cpus_per_shard
    return workers * config.cpus_per_worker + num_shards(config) * config.cpus_per_shard


def bundles(config: RunConfig) -> list[dict[str, float]]:
    """One bundle per worker actor: under --worker-group its group's resources (custom node resources
    included, which is what puts each group on its kind of node)."""
    groups = groups_section.rank_bundles(config)
    if groups:
        return groups
    worker = {"CPU": config.cpus_per_worker}
    if config.gpus_per_worker > 0:
        worker["GPU"] = config.gpus_per_worker
    return [dict(worker) for _ in range(config.num_worker_actors)]


def check_custom_resources(config: RunConfig) -> None:
    """Fail fast when the cluster has too little of a custom resource the groups ask for (a node kind
    that was never started with it, e.g. `ray start --resources '{"fast": 1}'`), where the placement
    group would wait until its timeout."""
    need: Counter[str] = Counter()
    for bundle in bundles(config):
        need.update({k: v for k, v in bundle.items() if k not in ("CPU", "GPU")})
    total = ray.cluster_resources()
    for name, amount in need.items():
        if amount > total.get(name, 0.0):
            raise ResourceError(
                f"the run's --worker-group(s) need {amount:g} of resource {name!r} but the cluster has "
                f"{total.get(name, 0.0):g}; start nodes with it (ray start --resources '{{\"{name}\": N}}') "
                "or change the group"
            )


def reserve(config: RunConfig, timeout_s: float = 60.0) -> PlacementGroup:
    """The workers' placement group: packed onto as few nodes as possible, or spread across them."""
    pg = placement_group(bundles(config), strategy=config.placement.upper())
    _wait_ready([pg], config, timeout_s)
    return pg


def reserve_replicas(config: RunConfig, timeout_s: float = 60.0) -> list[PlacementGroup]:
    """A grouped replica's placement (a pipeline's S stages, a sharded replica's D shards): one group per
    replica, its workers packed (STRICT_PACK where one node can hold them, PACK otherwise), and the
    replicas spread: each replica's group is steered, softly (`_soft_target_node_id`), to the node
    holding the fewest replicas so far that can hold its workers. Stages pass activations every
    micro-batch and shards gather every layer, so they belong together; replicas exchange gradients
    once per step, so they can be apart, and apart they use more nodes' memory and a node's loss takes
    fewer replicas with it. Ray places a group elsewhere when its target is busy."""
    stages = config.replica_size  # a replica's actors: its stages x shards
    bundle = bundles(config)[0]
    nodes = {n["NodeID"]: dict(n["Resources"]) for n in ray.nodes() if n["Alive"]}
    groups = []
    for target in replica_targets(nodes, bundle, stages, config.num_worker_actors // stages):
        if target is not None:
            groups.append(placement_group([dict(bundle)] * stages, strategy="STRICT_PACK", _soft_target_node_id=target))
        else:  # no node holds a whole replica: its stages span as few nodes as they can
            groups.append(placement_group([dict(bundle)] * stages, strategy="PACK"))
    _wait_ready(groups, config, timeout_s)
    return groups


def replica_targets(
    nodes: dict[str, dict[str, float]], bundle: dict[str, float], stages: int, replicas: int
) -> list[str | None]:
    """For each replica, the node to steer its group to: among the nodes whose resources (`nodes`:
    node id -> totals) still hold `stages` bundles, the one given the fewest replicas so far (ties: the
    most CPUs left, then the order given); None where no node can hold a whole replica."""
    need = {k: v * stages for k, v in bundle.items()}
    free = {n: dict(res) for n, res in nodes.items()}
    given: Counter[str] = Counter()
    targets: list[str | None] = []
    for _ in range(replicas):
        fits = [n for n, res in free.items() if all(res.get(k, 0.0) >= v for k, v in need.items())]
        if not fits:
            targets.append(None)
            continue
        target = min(fits, key=lambda n: (given[n], -free[n].get("CPU", 0.0)))
        given[target] += 1
        for k, v in need.items():
            free[target][k] -= v
        targets.append(target)
    return targets


def _wait_ready(groups: list[PlacementGroup], config: RunConfig, timeout_s: float) -> None:
    try:
        ray.get([pg.ready() for pg in groups], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for pg in groups:
            remove_placement_group(pg)
        how = "a replica's workers packed" if config.replica_size > 1 else config.placement
        raise ResourceError(
            f"could not place {config.num_worker_actors} workers ({how}) within {timeout_s:.0f}s; "
            "the cluster is busy or too small"
        ) from None


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """The node id each bundle of `pg` was placed on, in bundle order."""
    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in range(len(table))]


def quietest_nodes(worker_nodes: list[str], count: int) -> list[str]:
    """`count` node ids for parameter-server shards: the alive nodes hosting the fewest workers first
    (ties: the most CPUs), round-robin, so shards stay off the nodes the workers keep busy."""
    workers_on = Counter(worker_nodes)
    alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    alive.sort(key=lambda n: (workers_on[n["NodeID"]], -n["Resources"].get("CPU", 0)))
    order = [n["NodeID"] for n in alive]
    return [order[k % len(order)] for k in range(count)]


@dataclass
class Placement:
    """Where a run's actors go: the placement group(s) the run reserved itself (one, or under a
    pipeline one per replica), or the one a Tune trial holds (bundle 0 is the trial's driver, then the
    workers, then the PS shards)."""

    groups: list[PlacementGroup]
    first_worker: int  # bundle index of worker 0 (in groups[0])
    owned: bool  # reserved by this run (released at its end) or lent by a Tune trial
    per_group: int = 0  # workers per group when there are several (a pipeline's S); 0: all in groups[0]
    # A warm run's shards' own one-bundle groups (`shards` with `hold_cpus`), released with the rest.
    shard_groups: list[PlacementGroup] = field(default_factory=list)

    @property
    def group(self) -> PlacementGroup:
        return self.groups[0]

    def _bundle(self, rank: int) -> tuple[PlacementGroup, int]:
        if self.per_group:
            return self.groups[rank // self.per_group], rank % self.per_group
        return self.groups[0], self.first_worker + rank

    def worker(self, rank: int) -> PlacementGroupSchedulingStrategy:
        group, index = self._bundle(rank)
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)

    def worker_node(self, rank: int) -> str:
        """The node id worker `rank`'s bundle was placed on."""
        group, index = self._bundle(rank)
        return bundle_nodes(group)[index]

    def shards(self, workers: int, count: int, hold_cpus: float = 0.0) -> list[Any]:
        """Scheduling for `count` PS shards: in the trial's shard bundles, or (own group, which holds
        only workers) on the nodes with the fewest workers. With `hold_cpus` (a run whose shards may be
        kept warm, orchestrator/warm_pool.py, and so ask for no CPU of their own) each of those shards
        gets a one-bundle group of that many CPUs, steered to the same node, held until the run ends."""
        if self.owned and hold_cpus > 0:
            self._hold_shards(workers, count, hold_cpus)
            held = self.shard_groups[:count]
            return [PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=0) for g in held]
        if self.owned:
            nodes = [self.worker_node(rank) for rank in range(workers)]
            return [NodeAffinitySchedulingStrategy(n, soft=True) for n in quietest_nodes(nodes, count)]
        first = self.first_worker + workers
        return [
            PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=first + k) for k in range(count)
        ]

    def _hold_shards(self, workers: int, count: int, cpus: float, timeout_s: float = 60.0) -> None:
        """At least `count` shard groups of `cpus` CPUs (a later phase with more shards adds to them)."""
        if len(self.shard_groups) >= count and all(g.bundle_specs[0].get("CPU") == cpus for g in self.shard_groups):
            return
        for group in self.shard_groups:  # a phase asking for another size: start over
            remove_placement_group(group)
        nodes = quietest_nodes([self.worker_node(rank) for rank in range(workers)], count)
        self.shard_groups = [
            placement_group([{"CPU": cpus}], strategy="STRICT_PACK", _soft_target_node_id=node) for node in nodes
        ]
        try:
            ray.get([g.ready() for g in self.shard_groups], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ResourceError(
                f"could not place the {count} parameter-server shard(s) within {timeout_s:.0f}s; "
                "the cluster is busy or too small"
            ) from None


def place(config: RunConfig) -> Placement:
    """Inside a Tune trial, the trial's placement group (already sized by trial_resources, so Tune
    never oversubscribes the cluster); otherwise the group(s) reserved for this run."""
    group = get_current_placement_group()
    if group is None and config.elastic:  # one group per slot; the run starts once MIN are placed
        from distrain.orchestrator.membership import ElasticPlacement

        elastic = ElasticPlacement(config)
        try:
            elastic.wait_for_min(config.collective_timeout_s)
        except BaseException:
            elastic.release()
            raise
        return elastic  # type: ignore[return-value]  # the same interface (worker, shards, owned)
    if group is None:
        if config.replica_size > 1:  # a replica of S stages x D shards: one group, one node where it fits
            return Placement(reserve_replicas(config), 0, owned=True, per_group=config.replica_size)
        return Placement([reserve(config)], 0, owned=True)
    wanted = trial_resources.trial_bundles(config)
    if [b.get("CPU", 0.0) for b in group.bundle_specs] != [b["CPU"] for b in wanted]:
        raise ResourceError(
            f"run_training was called inside a placement group whose bundles {group.bundle_specs} do not match "
            f"this run's {wanted}; request trial_resources.trial_bundles(config) for the trial"
        )
    return Placement([group], trial_resources.FIRST_WORKER_BUNDLE, owned=False)


def release(placement: Placement | None) -> None:
    if placement is not None and hasattr(placement, "release"):  # an elastic run's groups
        placement.release()
        return
    if placement is not None and placement.owned:
        for group in placement.groups + placement.shard_groups:
            try:
                remove_placement_group(group)
            except Exception:  # already gone with the cluster
                pass
