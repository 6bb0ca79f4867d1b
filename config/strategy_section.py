"""The strategy section of the run's spec, and its checks: the consistency strategy, its transport, a
schedule of strategies, the traffic's codec and emulated link (`--compress`, `--comm-delay-ms`,
`--comm-bandwidth`), the pipeline, each strategy's own options; its checks across sections are
registered here (stage "across"): the link and codec, each strategy's `Options.check`, the pipeline, and
an elastic --workers range (which strategies can change membership). No torch, no Ray at import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.compression.spec import CODEC_HELP
from distrain.config.checks import config_check
from distrain.errors import ConfigError
from distrain.fields import setting

if TYPE_CHECKING:
    from distrain.config.run_config import RunConfig


@dataclass(frozen=True)
class StrategySection:
    """The consistency strategy, its transport, a schedule of strategies, and each strategy's own options."""

    strategy: str = setting(
        "bsp", "Consistency strategy (see `distrain strategies`), or auto: what `distrain plan` recommends.", "strategy"
    )
    transport: str = setting(
        "",
        "collective (all-reduce) or ps (parameter server); empty: the strategy's default (ps for async and ssp, "
        "collective for bsp and local-sgd).",
        "strategy",
        "per strategy",
    )
    ps_shards: int | None = setting(
        None,
        "Parameter-server shards K; default 1 (async, ssp, bsp --transport ps); across cut replicas exactly one "
        "per worker of a replica (D x T: --fsdp D, --tensor-parallel T or both), the default there.",
        "strategy",
    )
    schedule: str = setting(
        "", "Strategies in sequence, switching at epoch marks: name[:epochs],... e.g. bsp:2,local-sgd.", "strategy"
    )
    comm_delay_ms: float = setting(
        0.0, "Emulated network latency: every transfer takes at least this long, ms (experiments).", "strategy"
    )
    comm_bandwidth: str | None = setting(
        None,
        "Emulated link bandwidth per worker, e.g. 100mbit, 25gbit, 12.5MB/s: every transfer takes at least "
        "--comm-delay-ms + bytes / RATE (experiments).",
        "strategy",
        metavar="RATE",
    )
    compress: str | None = setting(
        None,
        f"Compress the strategy's traffic: {CODEC_HELP}; gradients under bsp, pushes on the parameter server, "
        "theta's change under local-sgd, "
        "pseudo-gradients under diloco.",
        "strategy",
        metavar="CODEC",
    )
    pipeline_stages: int = setting(
        1,
        "Pipeline (model) parallelism: cut the model into S stages, one actor each; --workers R replicas of the "
        "pipeline make S x R actors (actor rank = replica x S + stage); with --fsdp D each stage is sharded over "
        "D actors (rank = (replica x S + stage) x D + shard).",
        "strategy",
        metavar="S",
    )
    microbatches: int = setting(
        1,
        "Micro-batches M each replica's batch is cut into, with --pipeline-stages (M divides --batch-size).",
        "strategy",
        metavar="M",
    )
    pipeline_schedule: str = setting(
        "gpipe", "Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (PipeDream-Flush).", "strategy"
    )
    options: dict[str, Any] = setting(
        {}, "Each strategy's own options (its `Options` dataclass), by strategy name; see `distrain strategies`."
    )


# The channel's own fields (strategies/channel.py): the codec and the emulated link that every strategy's
# traffic goes through, whatever the strategy. `distrain plan` takes them as flags; its calibration runs
# without them (`traffic_defaults`) and adds what they change.
TRAFFIC_FIELDS = ("compress", "comm_delay_ms", "comm_bandwidth")


def traffic_defaults() -> dict[str, Any]:
    """The channel's fields at their defaults: no codec, no emulated link."""
    return {f.name: f.default for f in dataclasses.fields(StrategySection) if f.name in TRAFFIC_FIELDS}


@config_check(stage="across")
def check_link(config: RunConfig) -> None:
    """--compress, --comm-delay-ms, --comm-bandwidth: what every strategy's traffic goes through."""
    if config.comm_bandwidth is not None:
        from distrain.units import parse_rate

        parse_rate(config.comm_bandwidth)
    from distrain.compression import parse_codec

    codec = parse_codec(config.compress) if config.compress is not None else None
    if codec is not None:
        for cls in config.strategy_classes:
            cls.implementation(config).check_codec(config, codec)
    if config.precision == "fp16" and codec is not None:
        # An overflow step's inf would enter the codec's error-feedback residual and stay there.
        raise ConfigError("--precision fp16 cannot be combined with --compress; use --precision bf16 instead")
    value = config.comm_delay_ms
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"--comm-delay-ms must be >= 0, got {value}")
    if config.comm_delay_ms and config.comm_delay_ms / 1000 >= config.hang_timeout_s:
        # A worker answers the driver once per segment, and a segment with a transfer in it lasts at
        # least one emulated delay: every such run would end with its workers taken for hung.
        raise ConfigError(
            f"--comm-delay-ms {config.comm_delay_ms:g} ({config.comm_delay_ms / 1000:g} s per transfer) reaches "
            f"--hang-timeout-s {config.hang_timeout_s:g}: every worker would be taken for hung while it waits on "
            "the emulated link; raise --hang-timeout-s well above the delay or lower --comm-delay-ms"
        )


@config_check(stage="across")
def check_strategy_options(config: RunConfig) -> None:
    """Each strategy's own options check themselves against the run (`StrategyOptions.check`)."""
    for options in config.section("strategy").options.values():
        options.check(config)


@config_check(stage="across")
def check_pipeline(config: RunConfig) -> None:
    """--pipeline-stages composes with BSP over the collective transport only: each stage's gradient
    is all-reduced with its R copies before the step (strategies/pipeline.py says why not the rest)."""
    from distrain.strategies.pipeline import PIPELINE_SCHEDULES

    if config.pipeline_stages < 1:
        raise ConfigError(f"--pipeline-stages must be >= 1, got {config.pipeline_stages}")
    if config.microbatches < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {config.microbatches}")
    if config.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"unknown --pipeline-schedule {config.pipeline_schedule!r}; choose one of: {', '.join(PIPELINE_SCHEDULES)}"
        )
    if not config.pipelined:
        if config.microbatches != 1:
            raise ConfigError("--microbatches cuts a pipeline's batch; add --pipeline-stages S (S >= 2) or drop it")
        return
    if config.batch_size % config.microbatches:
        raise ConfigError(
            f"--microbatches {config.microbatches} does not divide the per-replica batch --batch-size "
            f"{config.batch_size}; pick M that divides it"
        )
    if config.schedule or config.strategy != "bsp" or config.transport != "collective":
        raise ConfigError(
            "--pipeline-stages runs with --strategy bsp over the collective transport only (each stage's "
            "gradient is averaged with its replicas'); drop --pipeline-stages or use bsp"
        )
    # (--backup-workers, bsp's, needs the PS transport: refused above and by bsp's own check.)
    if config.compress is not None:
        raise ConfigError("--compress does not compose with --pipeline-stages; drop one of them")
    if config.comm_delay_ms or config.comm_bandwidth:
        raise ConfigError("--comm-delay-ms/--comm-bandwidth do not apply to pipeline traffic; drop them")
    if config.precision != "fp32":  # the schedule's stages run outside LocalTrainer's autocast and loss scale
        raise ConfigError(f"--precision {config.precision} does not compose with --pipeline-stages; drop one of them")
    if 0 < config.gpus_per_worker < 1:
        # Stages that share a GPU talk over gloo (NCCL refuses two ranks on one GPU), and gloo cannot send
        # a CUDA tensor point to point: "writev ...: Bad address" (torch 2.11 on an H200, issue 29's probe).
        raise ConfigError(
            f"--pipeline-stages with --gpus-per-worker {config.gpus_per_worker:g}: stages sharing a GPU talk over "
            "gloo, which cannot send CUDA tensors point to point; give each stage a whole GPU (--gpus-per-worker 1) "
            "or train on CPUs"
        )


@config_check(stage="across")
def check_elastic(config: RunConfig) -> None:
    """A --workers range needs a strategy whose membership can change mid-run (`Strategy.elastic`):
    the others are refused naming those that can."""
    if not config.elastic:
        return
    given = f"--workers {config.workers}..{config.max_workers}"
    from distrain.strategies import STRATEGIES

    able = [name for name in STRATEGIES.names() if STRATEGIES.get(name).elastic]
    able += [  # those elastic on some transports only (bsp: over the collective)
        f"{name} over {'/'.join(STRATEGIES.get(name).elastic_transports)}"
        for name in STRATEGIES.names()
        if STRATEGIES.get(name).elastic_transports and not STRATEGIES.get(name).elastic
    ]
    if not all(cls.implementation(config).elastic for cls in config.strategy_classes):
        what = f"--schedule {config.schedule}" if config.schedule else f"--strategy {config.strategy}"
        raise ConfigError(
            f"{given}: {what} cannot change its membership mid-run; use a fixed --workers N, or a strategy "
            f"that can: {', '.join(able)}"
        )
    for flag, used in (
        ("--pipeline-stages", config.pipelined),
        # (--straggler composes: a slowdown belongs to a rank, RANK < MAX; a rank that is not a member
        # has nothing to slow, and one that rejoins is slowed again.)
        ("--schedule", bool(config.schedule)),
    ):
        if used:
            raise ConfigError(f"{given} does not compose with {flag}; use a fixed --workers N or drop {flag}")
    if config.compress is not None and config.transport == "collective":
        # The collective re-form (orchestrator/controller/collective_scaling.py): a compressed all-reduce's
        # codec state (residuals, PowerSGD's warm start) would have to agree across a changing group. Over
        # the PS each worker's push keeps its own residual, which nothing has to agree on: allowed there.
        raise ConfigError(
            f"{given} does not compose with --compress over the collective transport (a compressed all-reduce's "
            "codec state must agree across a group whose members change); use --strategy async|ssp|bsp with "
            "--transport ps (each worker's push keeps its own residual), a fixed --workers N, or drop --compress"
        )


def stages(config: RunConfig) -> int:
    """--pipeline-stages S: the actors each replica of the model is cut into (1: no pipeline)."""
    return config.section("strategy").pipeline_stages


def replicas_per_step(config: RunConfig) -> int:
    """Replicas whose batches one step hands out: --workers (an elastic run's MAX) plus those the run's
    strategies add (`StrategyOptions.extra_replicas`: bsp's backup workers)."""
    options = config.section("strategy").options.values()
    return config.worker_slots + sum(o.extra_replicas(config) for o in options)
