"""Starting and reading the parameter-server shard actors: what the PS shards' driver-actor spec builds
(`driver_actor.ps_shards`); the controller kills them with the phase's other driver-side actors, or,
after a completed run whose shards may be kept warm, retires them into the warm pool
(orchestrator/warm_pool.py), from which the next run's shard group on the same node takes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from distrain.strategies.partition import partition, ps_clients
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard
from distrain.strategies.sandblaster_shard import SandblasterShard
from distrain.trainers.optim_state import FlatOptimizerState

if TYPE_CHECKING:
    from distrain.config import RunConfig


def shard_concurrency(worker_actors: int) -> int:
    """Calls a shard serves at once: every worker's push-pull and the driver's, with room to spare."""
    return max(64, 4 * worker_actors)


def shard_pool_kind(sandblaster: bool, worker_actors: int) -> str:
    """The warm pool's kind of a run's shards (orchestrator/warm_pool.py): a warm shard serves only as many
    callers as it was made for, and only as the class it was made as."""
    return f"{'sandblaster_shard' if sandblaster else 'ps_shard'}/{shard_concurrency(worker_actors)}"


class ShardGroup:
    """K shard actors holding contiguous slices of θ, shard k scheduled by `scheduling[k]` (soft node
    affinity for a run's own placement, or a shard bundle: a Tune trial's, an elastic run's, or a warm
    run's own; see cluster.Placement).

    `pool`: the warm pool (orchestrator/warm_pool.py, handed down: this layer does not import the
    orchestrator) when the run's shards may be kept warm, else None. Where every shard has a bundle
    holding its CPUs, shard k is an idle shard of its class (a `SandblasterShard` under Sandblaster's rule,
    a `ParameterShard` otherwise) from the pool on its bundle's node, rebuilt (`ParameterShard.rebuild`:
    the class's own constructor, so a Sandblaster shard's accumulators and L-BFGS history start empty), or
    a fresh zero-CPU actor pinned to that node; `rebuilding` holds the rebuild calls (the spec's `ready`
    waits on them before anything else)."""

    def __init__(
        self,
        config: RunConfig,
        rule: ConsistencyRule,
        theta: np.ndarray,
        optimizer_state: FlatOptimizerState | None,
        scheduling: list[Any],
        bounds: list[tuple[int, int]] | None = None,
        task_builder: Any = None,
        pool: Any = None,
    ) -> None:
        """`bounds`: each shard's slice of `theta` (default: K near-equal contiguous slices)."""
        assert config.ps_shards is not None
        self.bounds = bounds if bounds is not None else partition(len(theta), config.ps_shards)
        assert len(self.bounds) == config.ps_shards, (self.bounds, config.ps_shards)
        self.clients = ps_clients(config)  # whom each shard's rule counts: worker actors, or replicas (--fsdp)
        spec = OptimizerSpec(config.optimizer, config.momentum, config.weight_decay, dict(config.optimizer_args))
        if config.task and task_builder is not None:  # a user task may bring its own optimizer
            from distrain.trainers.own_optimizer import defines_own

            if defines_own(task_builder(config)):  # (the shards build the task only then)
                spec.task_config, spec.task_builder = config, task_builder
        # Sandblaster's shards also hold its accumulators and L-BFGS history (strategies/sandblaster_shard.py).
        cls = SandblasterShard if rule.mode == "sandblaster" else ParameterShard
        concurrency = shard_concurrency(config.num_worker_actors)
        self.pool_kind = shard_pool_kind(cls is SandblasterShard, config.num_worker_actors)
        nodes = bundle_nodes(scheduling) if pool is not None else None
        self.pool = pool if nodes is not None else None
        self.rebuilding: list[Any] = []
        self.shards = []
        for k, (start, stop) in enumerate(self.bounds):
            args = (
                k,
                self.clients,
                rule,
                spec,
                theta[start:stop],
                optimizer_state.slice(start, stop).to_dict() if optimizer_state else None,
            )
            # k-of-n across cut replicas: shard 0 decides every shard's rounds (ps_shard.RoundReferee).
            given = {"referee": self.shards[0]} if rule.parts > 1 and k > 0 else {}
            shard = self.pool.take(nodes[k], self.pool_kind) if self.pool is not None else None
            if shard is not None:
                self.rebuilding.append(shard.rebuild.remote(*args, **given))
            else:
                if nodes is None:  # as before: its own CPUs, in its slot
                    where = {"num_cpus": config.cpus_per_shard, "scheduling_strategy": scheduling[k]}
                else:  # its bundle holds its CPUs; the actor can outlive the bundle's group
                    where = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[k], soft=False)}
                shard = ray.remote(cls).options(max_concurrency=concurrency, **where).remote(*args, **given)
            self.shards.append(shard)

    def node_ids(self) -> list[str]:  # (a retired shard answers this too)
        return ray.get([s.node_id.remote() for s in self.shards])

    def wait_rebuilt(self) -> None:
        """Until the warm shards taken are rebuilt (calls made after may otherwise run before)."""
        ray.get(self.rebuilding)

    def keep_warm(self) -> list[Any]:
        """After a completed run: retire the shards into the warm pool, as many as it keeps; returns those
        kept (the caller no longer kills them). None kept when one does not retire cleanly."""
        if self.pool is None:
            return []
        try:
            nodes = ray.get([s.retire.remote() for s in self.shards], timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            return []
        return self.pool.keep(self.shards, nodes, self.pool_kind)

    def stats(self) -> list[dict]:
        """Each shard's record of dropped gradients and round membership (`ParameterShard.stats`)."""
        return ray.get([s.stats.remote() for s in self.shards])


def bundle_nodes(scheduling: list[Any]) -> list[str] | None:
    """The node of each shard's bundle, or None where a shard has no bundle (a run's own placement that
    does not hold the shards' CPUs: those shards ask for their own, so they cannot be kept warm)."""
    if not all(isinstance(s, PlacementGroupSchedulingStrategy) for s in scheduling):
        return None
    return [
        placement_group_table(s.placement_group)["bundles_to_node_id"][s.placement_group_bundle_index]
        for s in scheduling
    ]
