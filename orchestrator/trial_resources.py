"""The resources one sweep trial asks Tune for: a placement-group bundle per actor it starts.

Pure arithmetic (no Ray), so a sweep can be sized and checked before anything starts. Bundle 0 is
the trial's driver (Tune's trial actor, which runs `run_training`); bundles 1..N are the workers,
then one per parameter-server shard. Tune starts a trial only when its whole group fits, so
concurrent trials never ask for more than the cluster has.
"""

from __future__ import annotations

from distrain.config import RunConfig, groups_section

# The trial driver only hands out work and records metrics; a sliver of a CPU keeps it accounted for
# without costing a worker slot (Ray drops an all-zero head bundle, which would shift every index).
DRIVER_BUNDLE = {"CPU": 0.01}
FIRST_WORKER_BUNDLE = 1


def num_shards(config: RunConfig) -> int:
    return config.ps_shards or 0  # set only when the run (or a phase of its --schedule) uses the PS


def trial_bundles(config: RunConfig) -> list[dict[str, float]]:
    worker = {"CPU": config.cpus_per_worker}
    if config.gpus_per_worker > 0:
        worker["GPU"] = config.gpus_per_worker
    workers = groups_section.rank_bundles(config) or [dict(worker) for _ in range(config.num_worker_actors)]
    shard = {"CPU": config.cpus_per_shard}
    return [dict(DRIVER_BUNDLE)] + workers + [dict(shard) for _ in range(num_shards(config))]


def trial_cpus(config: RunConfig) -> float:
    return sum(b.get("CPU", 0.0) for b in trial_bundles(config))


def trial_gpus(config: RunConfig) -> float:
    return sum(b.get("GPU", 0.0) for b in trial_bundles(config))
