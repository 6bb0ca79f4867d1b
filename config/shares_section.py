"""Heterogeneous workers' shares of each step's batch (--worker-weights, --balance speed;
docs/heterogeneous.md): what the weights make of the global batch, and the runs that cannot take unequal
shares yet, refused in one line.

Unequal shares keep the update the whole batch's only where a step's gradients are combined by one mean
that can be weighted (BSP over either transport; a pipeline's per-stage all-reduce over its replicas).
The others are refused rather than run wrong: k-of-n rounds and backup tasks (a round's mean is over
whichever gradients arrive first), sharded replicas (a replica's batch is cut again inside it), and
strategies without one mean per step. A pipeline's replicas take weights, one per replica, and --balance
speed, in whole sets of micro-batches (`pipeline_shares`; orchestrator/pipeline_balance.py). Under a
range (--workers MIN..MAX) only --balance speed over the collective transport takes shares (BSP, local
SGD, DiLoCo: each round a whole step cut among the members, `check_elastic_shares`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.config import groups_section
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
    if config.pipelined:
        return pipeline_shares(config, weights)
    return split_batch(config.global_batch_size, weights)


def pipeline_shares(config: RunConfig, weights: tuple[float, ...]) -> tuple[int, ...]:
    """A pipeline's replica shares: the global batch cut in whole sets of its P micro-batches (P = M x
    --accumulate-steps), b_r = P x u_r with u = split_batch(B / P, weights). torch's schedules allocate
    each stage's receive buffers from the first micro-batch's shape, so a replica's micro-batches must all
    be one size (--microbatches already divides --batch-size); with b_r a multiple of P they are, b_r / P
    each, and the schedule's mean over its P micro-batches is the mean over the replica's b_r samples."""
    from distrain.strategies.pipeline import PipelineShape

    parts = PipelineShape.of(config).micro
    return tuple(parts * u for u in split_batch(config.global_batch_size // parts, weights))


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
    if config.pipelined and groups_section.rank_shares(config):
        raise ConfigError(
            f"{groups_section.FLAG} does not compose with --pipeline-stages yet; a pipeline's replicas take "
            "--worker-weights or --balance speed"
        )
    for flag, used in (
        ("--schedule", bool(config.schedule)),
        ("--fsdp/--tensor-parallel", config.sharded),
    ):
        if used:
            raise ConfigError(f"{given} does not compose with {flag} yet; drop one of them")
    if config.pipelined and str(config.worker_weights).strip():
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


def check_replica_weights(config: RunConfig) -> None:
    """A pipeline's weights are one per replica (--workers R), not one per stage actor (R x S): said in
    those words, since R x S weights is the natural mistake. (Each replica always gets at least one
    sample per micro-batch: B / P = R x --batch-size / --microbatches >= R.)"""
    count = len(str(config.worker_weights).split(","))
    if count != config.worker_slots:
        raise ConfigError(
            f"{FLAG} {config.worker_weights!r} gives {count} weights for {config.worker_slots} pipeline replicas "
            f"(--workers {config.worker_slots}, {config.replica_size} stage actors each); give one per replica"
        )
