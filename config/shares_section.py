"""Heterogeneous workers' shares of each step's batch (--worker-weights, --balance speed;
docs/heterogeneous.md): what the weights make of the global batch, and the runs that cannot take unequal
shares yet, refused in one line.

Unequal shares keep the update the whole batch's only where a step's gradients are combined by one mean
that can be weighted (BSP over either transport; a pipeline's per-stage all-reduce over its replicas;
the all-reduce of cut replicas' gradient parts over the mesh's "replicate" group). The others are refused
rather than run wrong: k-of-n rounds and backup tasks (a round's mean is over whichever gradients arrive
first) and strategies without one mean per step. A replica of several workers (a pipeline's S stages,
a cut replica's D x T workers) takes one weight and one share per replica, in whole units (`share_unit`):
a pipeline's in sets of its micro-batches, a cut replica's in multiples of its D data-parallel ranks,
which split it equally (`replica_shares`; the balancer: orchestrator/pipeline_balance.py). Under a
range (--workers MIN..MAX) only --balance speed over the collective transport takes shares (BSP, local
SGD, DiLoCo: each round a whole step cut among the members, `check_elastic_shares`), plain workers' and
cut replicas' alike (a member replica's share in whole units: orchestrator/elastic_balance.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.config import groups_section, layout_section
from distrain.config.checks import config_check
from distrain.config.parsing import parse_worker_weights
from distrain.config.sections import BALANCE_MODES
from distrain.errors import ConfigError
from distrain.trainers.shares import split_batch

if TYPE_CHECKING:
    from distrain.config.run_config import RunConfig

FLAG = "--worker-weights"
# The strategies whose steps take unequal shares: BSP (one weighted mean of the gradients per step), local
# SGD and DiLoCo (equal numbers of local steps at unequal batches, averages weighted by samples trained on).
SHARED_STRATEGIES = ("bsp", "local-sgd", "diloco")


def worker_shares(config: RunConfig) -> tuple[int, ...] | None:
    """Each worker's samples per step under --worker-weights or --worker-group (its group's batch), in rank
    order (None: equal slices)."""
    groups = groups_section.rank_shares(config)
    if groups:
        return groups
    weights = parse_worker_weights(config.worker_weights, config.worker_slots)
    if not weights:
        return None
    return replica_shares(config, weights)


def share_unit(config: RunConfig) -> int:
    """The samples a replica's share is a whole number of. A pipeline's: its P micro-batches (P = M x
    --accumulate-steps; torch's schedules allocate each stage's receive buffers from the first
    micro-batch's shape, so a replica's micro-batches must all be one size, b_r / P each, and the
    schedule's mean over them is the mean over the replica's b_r samples). A cut replica's (--fsdp D,
    --tensor-parallel T): its data-parallel ranks, D (D x T under a hybrid plan), each taking b_r / D of
    the replica's block, so FSDP's mean over them is the mean over its b_r samples; times
    --accumulate-steps k, so that each rank's part cuts into its k micro-batches. 1 otherwise."""
    if config.pipelined:
        from distrain.strategies.pipeline import PipelineShape

        return PipelineShape.of(config).micro
    if config.sharded:
        return layout_section.data_ranks_per_replica(config) * config.accumulate_steps
    return 1


def replica_shares(config: RunConfig, weights: tuple[float, ...]) -> tuple[int, ...]:
    """Each replica's samples per step: the global batch cut in whole units (`share_unit`) by largest
    remainder, b_r = unit x u_r with u = split_batch(B / unit, weights) (each replica one unit at least)."""
    unit = share_unit(config)
    return tuple(unit * u for u in split_batch(config.global_batch_size // unit, weights))


def unequal_shares(config: RunConfig) -> bool:
    """Whether the run's workers may take unequal shares (--worker-weights, --worker-group or --balance speed)."""
    given = bool(str(config.worker_weights).strip()) or bool(groups_section.rank_shares(config))
    return given or config.balance != "none"


@config_check(stage="across")
def check_worker_shares(config: RunConfig) -> None:
    if config.balance not in BALANCE_MODES:
        raise ConfigError(f"unknown --balance {config.balance!r}; choose one of: {', '.join(BALANCE_MODES)}")
    if not unequal_shares(config):
        return
    given = (
        f"{FLAG} {config.worker_weights}"
        if str(config.worker_weights).strip()
        else groups_section.FLAG
        if groups_section.rank_shares(config)
        else "--balance speed"
    )
    check_elastic_shares(config, given)  # (--worker-group never has a range: its counts fix --workers)
    for layout, flag in ((config.pipelined, "--pipeline-stages"), (config.sharded, "--fsdp/--tensor-parallel")):
        if layout and groups_section.rank_shares(config):
            raise ConfigError(
                f"{groups_section.FLAG} does not compose with {flag} yet; a replica of several workers takes "
                "--worker-weights or --balance speed"
            )
    if bool(config.schedule):
        raise ConfigError(f"{given} does not compose with --schedule yet; drop one of them")
    if config.sharded:
        check_sharded_shares(config, given)
    if (config.pipelined or config.sharded) and str(config.worker_weights).strip():
        check_replica_weights(config)
    parse_worker_weights(config.worker_weights, config.worker_slots)  # numbers, positive, one per worker
    if config.strategy not in SHARED_STRATEGIES:
        raise ConfigError(
            f"{given} applies to --strategy {', '.join(SHARED_STRATEGIES)}, not --strategy {config.strategy}; drop it"
        )
    options = config.options_of("bsp") if config.strategy == "bsp" else None
    backups = (options.backup_workers, options.backup_tasks) if options is not None else (0, False)
    for flag, used in zip(("--backup-workers", "--backup-tasks"), backups, strict=True):
        if used:
            raise ConfigError(f"{given} does not compose with {flag}: a round's mean is over the first gradients in")
    if config.global_batch_size < config.worker_slots:
        raise ConfigError(
            f"{given}: a global batch of {config.global_batch_size} cannot give each of {config.worker_slots} "
            "workers a sample; raise --batch-size"
        )


def check_elastic_shares(config: RunConfig, given: str) -> None:
    """Shares under --workers MIN..MAX: --balance speed over the collective transport (BSP, local SGD,
    DiLoCo), whose rounds are lock-step blocks that can each be a whole step cut among the members
    (orchestrator/elastic_balance.py). Static weights are refused: a rank's slot is placed wherever there
    is room, so a per-rank weight names no machine. The parameter server's rounds take units as members
    ask: no step is held by a known set of members to cut."""
    if not config.elastic:
        return
    if str(config.worker_weights).strip():
        raise ConfigError(
            f"{given} does not compose with --workers MIN..MAX: a rank runs wherever its slot is placed, so a "
            "weight per rank names no machine; use --balance speed"
        )
    if config.strategy in SHARED_STRATEGIES and config.transport != "collective":
        raise ConfigError(
            f"{given} under --workers MIN..MAX needs the collective transport: the parameter server's elastic "
            "rounds take units as members ask for them, so no step is cut among its members; use --transport "
            "collective or a fixed --workers N"
        )
    # local SGD and DiLoCo: their blocks are whole steps cut among the members too, each member's average
    # weighted by the samples it took in the block (strategies/local_sgd.py `block_weight`).


def check_sharded_shares(config: RunConfig, given: str) -> None:
    """Shares across cut replicas (--fsdp D, --tensor-parallel T): BSP, local SGD and DiLoCo over the
    collective transport, whose averages across replicas run over the mesh's "replicate" group where a
    replica's weight can go in (strategies/sharded_bsp.py). Refused: cut replicas over the parameter
    server (a replica's D workers push their chunks to D shards, whose rounds are counted per push, not
    per sample) and cut pipelines (S > 1 with D or T > 1: not built). Under a range (--workers MIN..MAX,
    strategies/elastic_cut.py) --balance speed cuts each step among the member replicas in whole units, a
    joiner at the mean share, a leaver's share given to the others (orchestrator/elastic_balance.py);
    --worker-weights is refused there as for plain workers (`check_elastic_shares`)."""
    if config.transport != "collective":
        raise ConfigError(
            f"{given} across cut replicas (--fsdp/--tensor-parallel) runs over the collective transport only so "
            "far: the parameter server's shards count a round's pushes, not its samples; use --transport collective"
        )
    if config.pipelined:
        raise ConfigError(
            f"{given} does not compose with --pipeline-stages and --fsdp/--tensor-parallel together yet; drop one "
            "of them"
        )


def check_replica_weights(config: RunConfig) -> None:
    """The weights of a run whose replicas are several workers (a pipeline's S stages, a cut replica's
    D x T workers) are one per replica (--workers R), not one per worker actor: said in those words,
    since one per actor is the natural mistake. (Each replica always gets at least one unit: B / unit =
    R x --batch-size / --microbatches >= R for a pipeline, R x --batch-size for a cut replica.)"""
    count = len(str(config.worker_weights).split(","))
    if count != config.worker_slots:
        kind = "pipeline replicas" if config.pipelined else "cut replicas"
        actors = "stage actors" if config.pipelined else "workers"
        raise ConfigError(
            f"{FLAG} {config.worker_weights!r} gives {count} weights for {config.worker_slots} {kind} "
            f"(--workers {config.worker_slots}, {config.replica_size} {actors} each); give one per replica"
        )
