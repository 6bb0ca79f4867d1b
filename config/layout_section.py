"""The layout section: how one replica of the model is spread over workers (the *inner* parallelism).

A run is R replicas (`--workers R`, the outer dimension every strategy works across) of D x T x S
workers each: D-way sharded data parallelism inside the replica (`--fsdp D`: torch's FSDP2
`fully_shard`, ZeRO-3: parameters, gradients and optimizer state cut D ways), T-way tensor parallelism
(`--tensor-parallel T`: the task's planned layers split, trainers/tensor_parallel.py) and S pipeline
stages (the strategy section's `--pipeline-stages`). Actor rank = ((replica x S + stage) x D + shard) x T
+ tp (trainers/grid_position.py, `position_of` here): a data-parallel rank's T workers are neighbours,
then a stage's D shards, then a replica's S stages. Data-parallel rank (r, d) takes slice r x D + d of
each step's R x D x B samples, its T workers (and, in a pipeline, its S stages) share it; under a hybrid
plan (the built-in cnn's, trainers/builtin_names.py `tp_sample_ranks`) each of the T workers takes its
own: slice = rank of R x D x T x B samples. No torch, no Ray at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.config.checks import config_check
from distrain.config.groups_section import recorded_group_batch
from distrain.errors import ConfigError
from distrain.fields import setting
from distrain.trainers.builtin_names import tp_sample_ranks
from distrain.trainers.grid_position import GridPosition, grid_position

if TYPE_CHECKING:
    from distrain.config.run_config import RunConfig


@dataclass(frozen=True)
class LayoutSection:
    """How one replica is spread over workers: sharded data parallelism inside it."""

    fsdp: int = setting(
        1,
        "Sharded data parallelism inside each replica (FSDP2, ZeRO-3): D workers hold 1/D of its parameters, "
        "gradients and optimizer state each and take their own samples; --workers R such replicas make R x D "
        "workers and a global batch of R x D x --batch-size.",
        "layout",
        metavar="D",
    )
    tensor_parallel: int = setting(
        1,
        "Tensor parallelism inside each replica: T workers split the layers the task's plan names "
        "(Task.tensor_parallel_plan; the built-in mlp has one) and share one slice of each step's samples; "
        "the built-in cnn's hybrid splits its classifier and each of the T workers takes its own samples.",
        "layout",
        metavar="T",
    )
    reshard_after_forward: bool = setting(
        True,
        "--fsdp: free each layer's gathered parameters after its forward and gather them again for the backward "
        "(less memory, 3(D-1)/D x the parameter bytes moved per step instead of 2(D-1)/D).",
        "layout",
    )


# The flags that say how many replicas there are, how each is spread over workers, and each worker's
# batch (a BSP run may change them on --resume where the global batch stays: orchestrator/resume.py).
LAYOUT_FIELDS = frozenset(
    {
        "workers",
        "batch_size",
        "fsdp",
        "tensor_parallel",
        "reshard_after_forward",
        "pipeline_stages",
        "microbatches",
        "pipeline_schedule",
    }
)


# The strategies built across replicas cut over workers (strategies/sharded_bsp.py, sharded_diloco.py, with
# Streaming DiLoCo's fragments, sharded_local_sgd.py).
CUT_REPLICA_STRATEGIES = ("bsp", "diloco", "local-sgd")
# Those over the parameter server (strategies/sharded_ps.py): --fsdp D (PS shard d holding FSDP chunk d),
# --tensor-parallel T (PS shard t holding TP rank t's part) or both (PS shard d x T + t: worker (d, t)'s piece).
CUT_REPLICA_PS_STRATEGIES = ("async", "ssp", "bsp")
# How messages name the global batch a run's layout makes.
GLOBAL_BATCH = "--workers x --fsdp x --batch-size, x --tensor-parallel for the cnn's hybrid"


def position_of(config: RunConfig, rank: int) -> GridPosition:
    """`grid_position` for the run's D x T x S grid (config.replica_grid)."""
    shards, tp, stages = config.replica_grid
    return grid_position(rank, shards, tp, stages)


def shards_hint(shards: int) -> str:
    """The memory refusal's suggestion (orchestrator/memory.py), in this flag's words."""
    return f"--fsdp {shards} shards it so each worker fits"


def shards_per_replica(config: RunConfig) -> int:
    """D: the workers one replica's parameters are sharded over (1: not sharded)."""
    return config.section("layout").fsdp


def tp_degree(config: RunConfig) -> int:
    """T: the workers of a replica that split its planned layers and share its samples (1: none)."""
    return config.section("layout").tensor_parallel


def data_ranks_per_replica(config: RunConfig) -> int:
    """The workers of one replica that take their own B samples per step: D, or D x T under a hybrid plan."""
    return shards_per_replica(config) * tp_sample_ranks(config.model, config.task, tp_degree(config))


def with_shards(config: RunConfig, shards: int) -> RunConfig:
    """`config` with each replica sharded over `shards` workers (what the memory refusal tries)."""
    return config.replace(fsdp=shards)


def can_shard(config: RunConfig) -> bool:
    """Whether sharding composes with the rest of `config` (`check_layout` at D = 2)."""
    try:
        check_layout(with_shards(config, 2))
    except ConfigError:
        return False
    return True


def global_batch_of(recorded: dict[str, Any], slots: int) -> int:
    """R x D x B (x T under a hybrid plan) of a run from its flat recorded values (config.yaml, a
    checkpoint's config) and its replicas `slots` (a fixed --workers, or a range's MAX); runs recorded
    before --fsdp had D = 1, before --tensor-parallel T = 1."""
    tp = tp_sample_ranks(recorded.get("model"), recorded.get("task"), int(recorded.get("tensor_parallel") or 1))
    k = int(recorded.get("accumulate_steps") or 1)  # --accumulate-steps (1 in runs recorded before it)
    groups = recorded_group_batch(recorded)  # --worker-group: the groups' own batches
    if groups:
        return groups
    return slots * int(recorded.get("fsdp") or 1) * tp * k * int(recorded["batch_size"])


def grid_text(layout: dict[str, Any]) -> str:
    """How the display and the summary table name the workers of a `layout_of` grid: "2 workers", or a
    grouped replica's, "2 replicas x 2 shards" (--fsdp), "1 replica x 4 stages" (--pipeline-stages). A
    summary written before the grid was recorded has only its replicas: N workers. bsp's backup workers
    (counted in `worker_actors` beyond the replicas) follow the replicas: "2 workers (+1 backup)"."""
    backups = ""
    if isinstance(layout["replicas"], int) and layout.get("worker_actors") and layout.get("workers_per_replica"):
        extra = layout["worker_actors"] // layout["workers_per_replica"] - layout["replicas"]
        backups = f" (+{extra} backup{'s' if extra > 1 else ''})" if extra > 0 else ""
    parts = [
        f"{n} {what}"
        for n, what in (
            (layout.get("fsdp", 1), "shards"),
            (layout.get("tensor_parallel", 1), "tensor-parallel"),
            (layout.get("pipeline_stages", 1), "stages"),
        )
        if n > 1
    ]
    if not parts:
        return ("1 worker" if layout["replicas"] == 1 else f"{layout['replicas']} workers") + backups
    replicas = "1 replica" if layout["replicas"] == 1 else f"{layout['replicas']} replicas"
    return " x ".join([replicas + backups, *parts])


def layout_of(recorded: dict[str, Any], slots: int) -> dict[str, Any]:
    """The run's R x D x S grid from its flat recorded values, for summary.json: replicas (--workers: N,
    or an elastic run's "MIN..MAX"), shards per replica, pipeline stages, and the worker actors in all
    (`slots` replicas: N, or the range's MAX, plus bsp's --backup-workers at a fixed size: under a range
    the backups are among the MAX)."""
    shards, stages = int(recorded.get("fsdp") or 1), int(recorded.get("pipeline_stages") or 1)
    tp = int(recorded.get("tensor_parallel") or 1)
    if recorded.get("strategy") == "bsp" and ".." not in str(recorded["workers"]):
        slots += int(recorded.get("backup_workers") or 0)
    return {
        "replicas": recorded["workers"],
        "fsdp": shards,
        "tensor_parallel": tp,
        "pipeline_stages": stages,
        "workers_per_replica": shards * tp * stages,
        "worker_actors": slots * shards * tp * stages,
    }


@config_check(stage="across")
def check_layout(config: RunConfig) -> None:
    """--fsdp D >= 1 and --tensor-parallel T >= 1; a replica cut over workers runs under BSP, DiLoCo or
    local SGD over the collective transport, --precision and --compress included, so far (FSDP's own
    reduce-scatter inside a replica; across replicas an all-reduce of the shards every step, HSDP, or of
    each part at a period's end, under Streaming DiLoCo of each fragment's parts at the fragment's own
    steps; under --compress the channel's codec carries that all-reduce; --comm-delay-ms/--comm-bandwidth
    delay what crosses the replicas through the channel, `check_layout_link`), alone but for --fsdp with
    --pipeline-stages (BSP only: the strategy section refuses pipelines under the others, and --compress
    with them); or, --fsdp D and/or --tensor-parallel T, under async, SSP or BSP over the PS
    (`check_ps_layout`: D x T PS shards, shard d x T + t holding worker (d, t)'s piece of every tensor);
    or, --fsdp D alone, under Sandblaster (`check_sandblaster_layout`)."""
    d, t = shards_per_replica(config), tp_degree(config)
    for flag, value in (("--fsdp", d), ("--tensor-parallel", t)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if d * t == 1:
        return
    given = " ".join(f for f, v in ((f"--fsdp {d}", d), (f"--tensor-parallel {t}", t)) if v > 1)
    if not config.schedule and config.transport == "ps" and config.strategy in CUT_REPLICA_PS_STRATEGIES:
        check_ps_layout(config, d, t, given)
        return
    if not config.schedule and config.strategy == "sandblaster":
        check_sandblaster_layout(config, d, t, given)
        return
    if config.schedule or config.strategy not in CUT_REPLICA_STRATEGIES or config.transport != "collective":
        raise ConfigError(
            f"{given} runs with --strategy {', '.join(CUT_REPLICA_STRATEGIES[:-1])} or {CUT_REPLICA_STRATEGIES[-1]} "
            "over the collective transport, async, ssp or bsp over --transport ps, or sandblaster with --fsdp, "
            "so far (the other "
            "strategies across cut replicas are not built yet); drop it or use one of those"
        )
    if config.pipelined and tp_sample_ranks(config.model, config.task, t) > 1:
        # A hybrid plan's T workers each feed their own samples through the convolutions: a stage boundary
        # would hand stage s + 1 T different batches where torch's schedule has one micro-batch.
        raise ConfigError(
            f"--tensor-parallel {t} with the {config.model} model's hybrid plan (each tensor-parallel "
            "worker on its own samples) does not compose with --pipeline-stages; drop one of them"
        )
    if config.elastic:
        check_elastic_layout(config, given)
    # (--compress composes: the average across replicas goes through the channel's codec, part by part,
    # while FSDP's reduce-scatter inside a replica stays float32: strategies/sharded_bsp.py.)
    # (--precision composes: FSDP's MixedPrecisionPolicy, autocast under tensor parallelism alone, fp16's
    # loss scale with one skip decision over the run: trainers/sharded_trainer.py, strategies/sharded_bsp.py.
    # fp16 with --compress stays refused for every run: strategy_section.py.)
    check_layout_link(config, given)


def link_carries_replica_traffic(config: RunConfig) -> bool:
    """Whether the traffic across a collective run's cut replicas goes through the channel, whose emulated
    link (--comm-delay-ms, --comm-bandwidth, strategies/network.py) it pays: DiLoCo's pseudo-gradients and
    local SGD's rounds always; BSP's gradient under --compress or unequal replica shares
    (strategies/sharded_bsp.py `channel_grads`). Plain BSP's all-reduce across the replicas is HSDP's, run
    inside FSDP's backward, which no channel call makes."""
    from distrain.compression.spec import codec_of

    if config.strategy != "bsp":
        return True
    return codec_of(config) is not None or (config.unequal_shares and config.worker_slots > 1)


def check_layout_link(config: RunConfig, given: str) -> None:
    """--comm-delay-ms/--comm-bandwidth across cut replicas: the link is the one between replicas. It delays
    what crosses them through the channel (each worker's transfer of its part, on its own link, as plain
    workers' transfers are), while FSDP's and tensor parallelism's collectives inside a replica (NVLink,
    one node) stay undelayed; refused where the crossing traffic does not go through the channel."""
    if (config.comm_delay_ms or config.comm_bandwidth) and not link_carries_replica_traffic(config):
        raise ConfigError(
            f"{given} with --strategy bsp does not compose with --comm-delay-ms/--comm-bandwidth: its average "
            "across replicas is HSDP's all-reduce inside FSDP, which the emulated link cannot delay; add "
            "--compress (the average then goes through the channel and its link) or use --strategy diloco or "
            "local-sgd"
        )


def check_sandblaster_layout(config: RunConfig, d: int, t: int, given: str) -> None:
    """Sandblaster across cut replicas (strategies/sharded_sandblaster.py): --fsdp D with exactly D PS shards
    (shard d holds FSDP chunk d of every tensor), a replica's D workers taking each portion together.
    Refused, not yet built: --tensor-parallel, --pipeline-stages, --workers MIN..MAX."""
    for flag, used in (
        ("--tensor-parallel", t > 1),
        ("--pipeline-stages", config.pipelined),
        ("--workers MIN..MAX", config.elastic),
    ):
        if used:
            raise ConfigError(
                f"--strategy sandblaster across cut replicas runs with --fsdp D only; {flag} is not yet "
                "supported with it; drop it"
            )
    if config.ps_shards != d:
        raise ConfigError(
            f"--ps-shards {config.ps_shards} with {given}: PS shard d holds FSDP chunk d of every tensor, so "
            f"there are exactly {d}; drop --ps-shards or give {d}"
        )


def ps_shards_needed(d: int, t: int) -> int:
    """The PS shards across cut replicas: one per worker of a replica, D x T (--fsdp D, --tensor-parallel T
    or both: shard d x T + t holds worker (d, t)'s piece), the default --ps-shards there."""
    return d * t


# Under --workers MIN..MAX over the collective (strategies/elastic_cut.py): BSP (elastic_sharded_bsp.py), local
# SGD and DiLoCo (their blocks) with --fsdp D and/or --tensor-parallel T and --precision.
ELASTIC_CUT_STRATEGIES = ("bsp", "local-sgd", "diloco")


def check_elastic_layout(config: RunConfig, given: str) -> None:
    """--workers MIN..MAX across cut replicas (strategies/elastic_cut.py): whole replicas join and leave,
    under bsp, local-sgd or diloco over the collective transport, replicas of D x T workers (--fsdp D,
    --tensor-parallel T: a joiner's worker (d, t) takes live worker (d, t)'s pieces) with --precision
    bf16|fp16 (fp16's loss scale goes with the state at a re-form, and an overflow is skipped by every member
    alike), the cnn's hybrid plan included (each tensor-parallel worker dealt its own unit); local SGD's and
    DiLoCo's rounds (their blocks) go through the channel, so the emulated link delays them, as at a fixed
    size; --balance speed (the member replicas' shares, each whole units of the replica's data-parallel
    ranks, orchestrator/elastic_balance.py; the average across replicas weighted by them). (Refused
    elsewhere, as for plain workers: --worker-weights with a range, shares_section.py `check_elastic_shares`;
    --adaptive-tau and Streaming DiLoCo with a range, in their strategies' option checks; --compress with a
    range over the collective, strategy_section.py.)"""
    if config.strategy not in ELASTIC_CUT_STRATEGIES:
        raise ConfigError(
            f"{given} with --workers MIN..MAX runs under --strategy {', '.join(ELASTIC_CUT_STRATEGIES[:-1])} or "
            f"{ELASTIC_CUT_STRATEGIES[-1]} only so far (elastic {config.strategy} across cut replicas is not "
            "built yet); drop the range or use one of those"
        )
    if config.pipelined:
        raise ConfigError(
            f"{given} with --workers MIN..MAX does not compose with --pipeline-stages yet; drop one of them"
        )
    # --balance speed composes (config/shares_section.py `check_elastic_shares`: the member replicas' shares in
    # whole units, orchestrator/elastic_balance.py); --worker-weights under a range is refused there, as for
    # plain workers.


def check_ps_layout(config: RunConfig, d: int, t: int, given: str) -> None:
    """async, ssp, bsp over --transport ps across cut replicas (strategies/sharded_ps.py): --fsdp D,
    --tensor-parallel T (the cnn's hybrid plan included) or both, with exactly one PS shard per worker of a
    replica (`ps_shards_needed`: shard d holds FSDP chunk d of every tensor, what worker d holds; or shard
    t holds TP rank t's part of every tensor the plan splits and chunk t of every other; or, under both,
    shard d x T + t holds worker (d, t)'s piece, FSDP chunk d of those); bsp with --backup-workers K (N + K
    replicas, each round the first N whose pieces all arrived, agreed by the shards); bsp with --backup-tasks
    under --fsdp D at a fixed size (a replica's D workers take each chunk of portions together, each its
    1/D of the chunk's samples: the global batch must split into P x D equal parts); --compress (each
    worker's piece through the codec with its own residual); --comm-delay-ms/--comm-bandwidth (each
    worker's push-pull to its shard on its own link, as a plain worker's). Refused: --backup-tasks with
    --tensor-parallel or --workers MIN..MAX (not yet), --pipeline-stages. Under --workers
    MIN..MAX whole replicas of D x T workers join and leave (docs/elastic.md; a joiner's worker (d, t) pulls
    its piece from PS shard d x T + t, and under --compress starts with a zero residual, a leaver's residual
    leaving with it; bsp's --backup-workers K makes each round the first members - K member replicas
    complete, agreed by the shards); there unequal shares are refused."""
    needed = ps_shards_needed(d, t)
    if config.ps_shards != needed:
        what = {
            (True, False): "d holds FSDP chunk d",
            (False, True): "t holds tensor-parallel part t",
            (True, True): "d x T + t holds worker (d, t)'s piece",
        }[d > 1, t > 1]
        raise ConfigError(
            f"--ps-shards {config.ps_shards} with {given}: PS shard {what} of every tensor, so there are exactly "
            f"{needed}; drop --ps-shards or give {needed}"
        )
    options = config.options_of("bsp") if config.strategy == "bsp" else None
    if options and options.backup_tasks:  # a replica's D workers take each chunk together (sharded_backup_tasks.py)
        if t > 1:
            raise ConfigError(
                f"{given} over --transport ps does not compose with --backup-tasks yet under --tensor-parallel "
                "(not yet: only --fsdp D); use --backup-workers, or drop one of them"
            )
        if config.elastic:
            raise ConfigError(
                f"{given} over --transport ps with --backup-tasks does not compose with --workers MIN..MAX yet "
                "(not yet: a fixed number of replicas); give one --workers count, or drop one of them"
            )
        portions = options.portions or 2 * config.worker_slots  # (the resolved default)
        if config.global_batch_size % (portions * d):
            raise ConfigError(
                f"--portions {portions} with {given}: each portion is cut into {d} equal parts, one per FSDP "
                f"rank, and {portions} x {d} does not divide the global batch {config.global_batch_size}"
            )
    if config.pipelined:
        raise ConfigError(f"{given} over --transport ps does not compose with --pipeline-stages yet; drop one of them")
    if config.elastic:  # whole replicas join and leave (strategies/sharded_ps.py)
        for flag, used in (
            # (--backup-workers composes: the referee on shard 0 decides each round among the member
            # replicas of that round, members - K of them, for every shard: strategies/ps_shard.py.)
            # (--compress composes: each worker's push has its own residual, which nothing has to agree on;
            # a leaver's leaves with it, as its in-flight gradient does, and a joiner's starts at zero.)
            ("--balance speed/--worker-weights", bool(config.balance == "speed" or config.worker_weights)),
        ):
            if used:
                raise ConfigError(
                    f"{given} over --transport ps with --workers MIN..MAX does not compose with {flag} yet; "
                    "drop one of them"
                )
