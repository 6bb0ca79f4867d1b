"""Driver-side actors as a strategy declares them (`Strategy.driver_actors`): the specs the controller starts.

A strategy that needs something hosted beside its workers (the parameter-server shards, backup tasks'
portion scheduler, Sandblaster's coordinator, a plugin's own actor) returns one `DriverActor` per actor
from `driver_actors(phase)`. The controller (orchestrator/controller/ray_group.py) knows none of them by
class: for each phase it starts the specs in the order given (so a later one is built with an earlier
one's handle: the coordinator drives the shards), waits on what `ready` asks of each, watches and kills
them with the workers, forwards its notices (`notices`) and hands every handle to the workers by name
(`StrategyContext.driver_actors[name]`) and, at the end, to `Strategy.actor_figures`.

No Ray here: a spec is a plain description, tested without a cluster (tests/unit/test_driver_actor.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from distrain.config import RunConfig
    from distrain.strategies.consistency import ConsistencyRule
    from distrain.trainers.optim_state import FlatOptimizerState

# What the driver tells a driver-side actor, each a method of that name on it: a worker left or died
# (`worker_lost(rank)`: hand out again what it held), the straggler detector's verdict (`mark_slow(ranks)`).
NOTICES = frozenset({"worker_lost", "mark_slow"})
PS_SHARDS = "ps_shards"  # the shards' spec name: the PS transport's calls (clocks, members) go to it


@dataclass
class ActorSetup:
    """What a phase's driver-side actors are built from (the controller fills it in per phase)."""

    phase: RunConfig
    workers: int  # worker ranks of the run (an elastic run's maximum)
    start_step: int  # the global step the phase starts (or goes on) at
    steps_per_epoch: int
    optimizer: FlatOptimizerState | None = None  # the optimizer state the phase starts from (None: fresh)
    counters: dict[str, Any] | None = None  # the shards' version and clocks going on from a checkpoint
    started: dict[str, Any] = field(default_factory=dict)  # handles of the specs started before, by name
    # The first member's flat parameters, and Ray scheduling for `count` actors in the run's shard slots
    # (the controller's; asked only by the specs that need them: θ is a call to a worker).
    params: Callable[[], np.ndarray] = lambda: _unset("params")
    shard_slots: Callable[[int], list[Any]] = lambda count: _unset("shard_slots")
    # The shapes of the model's trainable parameters, in order (a call to a worker): under --fsdp D the
    # shards hold θ in FSDP's chunk order (trainers/shard_layout.py).
    param_shapes: Callable[[], list[tuple[int, ...]]] = lambda: _unset("param_shapes")
    # For each of them, the dimension the task's tensor-parallel plan splits it along across T workers (None:
    # held whole), a call to a worker: under --tensor-parallel T the shards hold TP rank t's parts.
    param_cut_dims: Callable[[int], list[int | None]] = lambda tp: _unset("param_cut_dims")
    # Builds the run's task from its config (the orchestrator's `build_task`, handed down so this layer
    # need not import it): PS shards build a task's own optimizer (`Task.configure_optimizers`) with it.
    task_builder: Callable[[RunConfig], Any] | None = None
    # The warm pool (orchestrator/warm_pool.py: take, keep) when the run's shards may come from and go to
    # it (strategies/ps_shard_group.py), else None.
    pool: Any = None
    _theta: Any = field(default=None, init=False, repr=False)

    def theta(self) -> np.ndarray:
        """The first member's flat θ, fetched once per phase."""
        if self._theta is None:
            self._theta = self.params()
        return self._theta


def _unset(what: str) -> Any:
    raise RuntimeError(f"ActorSetup.{what} was not given")


def no_args(setup: ActorSetup) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class DriverActor:
    """One driver-side actor: `actor` hosted by Ray with `num_cpus` and `max_concurrency`, built as
    `actor(**args(setup))`; or, with `build`, whatever `build(setup)` starts itself."""

    name: str  # workers find its handle as ctx.driver_actors[name]; actor_figures gets it under the name
    actor: type | None = None
    args: Callable[[ActorSetup], dict[str, Any]] = no_args
    num_cpus: float = 0
    # None: 4 calls per worker and at least 64 (every worker may be waiting in it at once).
    max_concurrency: int | None = None
    # Calls to make once it is up, before the workers set up: refs the controller waits on (a dead or
    # silent actor ends the attempt as a lost shard would).
    ready: Callable[[Any, ActorSetup], list[Any]] | None = None
    notices: tuple[str, ...] = ()  # of NOTICES: what the driver forwards to it
    # Starts the actor(s) itself: (the handle the workers and figures get, the Ray actors behind it,
    # which the controller watches and kills). For a group of actors, e.g. the PS shards' ShardGroup.
    build: Callable[[ActorSetup], tuple[Any, list[Any]]] | None = None

    def __post_init__(self) -> None:
        if (self.actor is None) == (self.build is None):
            raise ConfigError(f"driver actor {self.name!r}: give exactly one of actor= (a class) and build=")
        unknown = set(self.notices) - NOTICES
        if unknown:
            raise ConfigError(
                f"driver actor {self.name!r}: unknown notices {sorted(unknown)}; known: {', '.join(sorted(NOTICES))}"
            )

    def concurrency(self, workers: int) -> int:
        return self.max_concurrency if self.max_concurrency is not None else max(64, 4 * workers)


def start_in_order(
    specs: tuple[DriverActor, ...],
    setup: ActorSetup,
    launch: Callable[[DriverActor, ActorSetup], Any],
    wait: Callable[[list[Any]], Any],
    processes: list[Any],
) -> None:
    """Start `specs` in order, each handle into `setup.started` under its name before the next is built
    (which may read it), and each up (`wait` on its `ready` calls) before the next starts; `launch` hosts
    an `actor=` spec (the controller's Ray). The actors behind each go into `processes` as they start, so
    a failure part-way (a `ready` call that times out) still leaves the caller all it must kill."""
    for spec in specs:
        if spec.build is not None:
            handle, behind = spec.build(setup)
        else:
            handle = launch(spec, setup)
            behind = [handle]
        processes.extend(behind)
        setup.started[spec.name] = handle
        if spec.ready is not None:
            wait(spec.ready(handle, setup))


def checked(strategy: str, specs: Any) -> tuple[DriverActor, ...]:
    """A strategy's `driver_actors` answer, refused (one line) where it is not specs with distinct names:
    a plugin written against the names of old ("ps_shards", "portion_scheduler") gets the way over."""
    specs = tuple(specs)
    names = [getattr(s, "name", None) for s in specs]
    if not all(isinstance(s, DriverActor) for s in specs):
        raise ConfigError(
            f"--strategy {strategy}: driver_actors() returned {specs!r}; it returns distrain.DriverActor specs "
            "now, not names (a PS rule's shards: super().driver_actors(config))"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"--strategy {strategy}: driver_actors() names an actor twice: {names}")
    return specs


def ps_shards(rule: ConsistencyRule) -> DriverActor:
    """The parameter-server shards under `rule`: a ShardGroup (strategies/ps_shard_group.py) over the run's
    shard slots, starting from the first member's θ and the phase's optimizer state; a run going on from a
    checkpoint in the phase it was taken in gives them back their versions and clocks. Under --fsdp D the
    D shards hold θ and the optimizer state permuted so that shard d holds FSDP chunk d of every tensor
    (strategies/sharded_ps.py), and count one client per replica; under --tensor-parallel T the T shards
    hold TP rank t's part of every tensor the plan splits and chunk t of every other; under both the D x T
    shards hold worker (d, t)'s pieces (`ps_layout`)."""

    def build(setup: ActorSetup) -> tuple[Any, list[Any]]:
        from distrain.strategies.ps_shard_group import ShardGroup

        where = setup.shard_slots(setup.phase.ps_shards or 1)
        theta, optimizer, bounds = setup.theta(), setup.optimizer, None
        if setup.phase.sharded:
            layout = ps_layout(setup.phase, setup.param_shapes(), setup.param_cut_dims)
            theta, bounds = layout.to_shards(theta), layout.bounds
            if optimizer is not None:
                vectors = {k: layout.to_shards(v) for k, v in optimizer.vectors.items()}
                optimizer = type(optimizer)(vectors, dict(optimizer.scalars))
        group = ShardGroup(
            setup.phase, rule, theta, optimizer, where, bounds, task_builder=setup.task_builder, pool=setup.pool
        )
        return group, list(group.shards)

    def ready(group: Any, setup: ActorSetup) -> list[Any]:
        rebuilt = list(group.rebuilding)  # warm shards taken from the pool: built before the workers set up
        counters = setup.counters
        if counters is None:
            return rebuilt
        group.wait_rebuilt()  # and before their counters are set (an async actor may reorder calls)
        clock = max(counters["clocks"]) if rule.mode == "bounded" else counters["version"]
        from distrain.strategies.partition import ps_clients

        clocks = [clock] * ps_clients(setup.phase)
        # A task's own scheduler's position, where the shards step one (strategies/ps_shard.py).
        scheduler = (counters["scheduler"],) if "scheduler" in counters else ()
        return [s.set_counters.remote(counters["version"], clocks, *scheduler) for s in group.shards]

    return DriverActor(PS_SHARDS, build=build, ready=ready)


def ps_layout(config: RunConfig, shapes: list[tuple[int, ...]], cut_dims: Callable[[int], list[int | None]]) -> Any:
    """The PS shards' order of θ across cut replicas (trainers/shard_layout.py), one shard per worker of a
    replica: under --fsdp D, D pieces of every tensor along dim 0 (FSDP's chunks); under --tensor-parallel
    T, T pieces of every tensor, a split one along the dimension the plan splits (`cut_dims`: what TP rank
    t holds), a whole one along dim 0; under both, D x T pieces, worker (d, t)'s FSDP chunk d of TP rank t's
    part (a whole tensor: rank t's rows of FSDP chunk d). strategies/sharded_ps.py: worker (d, t) pushes
    its piece of its gradient, and the T workers of a data-parallel rank share the pulled whole tensors."""
    from distrain.trainers.shard_layout import ShardLayout

    shards, tp, _ = config.replica_grid
    return ShardLayout(shapes, shards, cut_dims(tp) if tp > 1 else None, tp)
