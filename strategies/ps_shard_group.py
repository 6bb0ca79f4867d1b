"""Starting and reading the parameter-server shard actors: what the PS shards' driver-actor spec builds
(`driver_actor.ps_shards`); the controller kills them with the phase's other driver-side actors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from distrain.strategies.partition import partition, ps_clients
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard
from distrain.strategies.sandblaster_shard import SandblasterShard
from distrain.trainers.optim_state import FlatOptimizerState

if TYPE_CHECKING:
    from distrain.config import RunConfig


class ShardGroup:
    """K shard actors holding contiguous slices of θ, shard k scheduled by `scheduling[k]` (soft node
    affinity for a run's own placement, or a Tune trial's shard bundle; see cluster.Placement)."""

    def __init__(
        self,
        config: RunConfig,
        rule: ConsistencyRule,
        theta: np.ndarray,
        optimizer_state: FlatOptimizerState | None,
        scheduling: list[Any],
        bounds: list[tuple[int, int]] | None = None,
        task_builder: Any = None,
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
        actor = ray.remote(SandblasterShard if rule.mode == "sandblaster" else ParameterShard)
        self.shards = [
            actor.options(
                num_cpus=config.cpus_per_shard,
                max_concurrency=max(64, 4 * config.num_worker_actors),
                scheduling_strategy=scheduling[k],
            ).remote(
                k,
                self.clients,
                rule,
                spec,
                theta[start:stop],
                optimizer_state.slice(start, stop).to_dict() if optimizer_state else None,
            )
            for k, (start, stop) in enumerate(self.bounds)
        ]

    def node_ids(self) -> list[str]:
        return ray.get([s.node_id.remote() for s in self.shards])

    def stats(self) -> list[dict]:
        """Each shard's record of dropped gradients and round membership (`ParameterShard.stats`)."""
        return ray.get([s.stats.remote() for s in self.shards])
