"""The strategy contract: what happens between "gradients are ready" and "the next batch starts".

A worker actor owns one `LocalTrainer` and one `Strategy`. Per step it computes the gradient into the
trainer's flat buffer, then calls `Strategy.step`, which communicates (all-reduce, push/pull, or
nothing) and applies the update. The strategy returns what it moved and how long it waited, so every
metrics row says so.

A strategy is one module. Its class declares everything the rest of distrain learns from it:
- `Options`: its own config dataclass (fields made with `distrain.fields.setting`): the CLI makes them
  flags, YAML nests them under the strategy's name, Tune can sweep them; `resolved` fills defaults that
  depend on the run, `check` refuses bad values (one line each);
- `transports` it runs on (the first is its default), `independent_workers` (no epoch barrier);
- `driver_actors(config)`: the actors the driver starts for it, as specs (strategies/driver_actor.py:
  class, Ray options, constructor arguments from the phase; the controller starts them and hands each
  worker their handles in `StrategyContext.driver_actors`);
- `metric_columns`: extra per-step columns it fills through `CommStats.extra`;
- `summary_figures(steps)` and `actor_figures(config, actors)`: extra figures for summary.json, from its
  step rows and from its driver-side actors;
- `extra_state` / `load_extra_state`: state of its own that checkpoints carry and `--resume` restores.
- `checkpoint_shards`: workers that write their own shards of a checkpoint (sharded replicas) do it here.

This module imports neither torch nor Ray: `distrain strategies`, `--help` and flag errors need only the
declarations.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from distrain.compression.spec import FLAG
from distrain.errors import ConfigError
from distrain.strategies.declarations import ColumnPlot, PlanningSetting, StepColumns  # noqa: F401 - the contract's
from distrain.strategies.driver_actor import DriverActor, ps_shards

if TYPE_CHECKING:
    import torch

    from distrain.compression import CodecSpec
    from distrain.config import RunConfig
    from distrain.strategies.channel import Channel, Traffic
    from distrain.strategies.ps_shard import ConsistencyRule
    from distrain.trainers.local_trainer import LocalTrainer
    from distrain.trainers.precision import LossScaler


class StrategyOptions:
    """Base of a strategy's own config dataclass (declare it `@dataclass(frozen=True)`)."""

    def resolved(self, run: RunConfig) -> StrategyOptions:
        """A copy with the defaults that depend on the run filled in (e.g. portions = 2 x workers).
        `run` is the run's config with every other section resolved."""
        return self

    def check(self, run: RunConfig) -> None:  # noqa: B027 - optional hook
        """Raise ConfigError (naming the flag) for a value this run cannot use."""

    def extra_replicas(self, run: RunConfig) -> int:
        """Replicas each step hands a batch to beyond --workers (BSP's k-of-n backup workers): the
        driver sizes the run's actors and its steps' samples with them (config/strategy_section.py)."""
        return 0


@dataclass(frozen=True)
class NoOptions(StrategyOptions):
    """A strategy without flags of its own."""


class NonFinite(Exception):
    """A step's loss, gradient or average is not finite and --on-nonfinite is stop: the worker ends its
    segment there and the driver ends the run as diverged (orchestrator/worker.py, orchestrator/run.py)."""


def all_finite(t: torch.Tensor) -> bool:
    """One reduction over the flat buffer: a NaN or inf anywhere makes the sum NaN or inf. (A sum that
    overflows float32 from finite values means gradients near 1e38: diverged all the same.)"""
    return bool(t.sum().isfinite())


@dataclass(frozen=True)
class StrategyContext:
    """Where a worker stands and how it reaches the others (filled in by the orchestrator)."""

    rank: int
    world_size: int
    device: str
    rendezvous: str = ""  # "host:port" of rank 0's TCP store, for the collective transport
    ps_shards: tuple[Any, ...] = ()  # parameter-server shard actor handles
    ps_bounds: tuple[tuple[int, int], ...] = ()  # each shard's [start, stop) of the flat vector
    # The strategy's driver-side actors' handles, by spec name (`Strategy.driver_actors`), e.g. backup
    # tasks' "portion_scheduler".
    driver_actors: Mapping[str, Any] = field(default_factory=dict)
    total_steps: int = 0  # the run's length in global steps (0: not known), e.g. for --tau-interval 10%


@dataclass
class ShardsSaved:
    """A worker's save of its own shards begun (`Strategy.checkpoint_shards`)."""

    blocked_s: float  # the seconds training waited for it (the rest is written in the background)
    finite: bool  # this worker's parameters were finite (the driver writes no checkpoint unless all were)


@dataclass
class CommStats:
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float | None = None  # blocked by a consistency rule (PS strategies)
    read_version: int | None = None
    applied_version: int | None = None
    lag: int | None = None  # PS: versions between a gradient's read and its apply (the "staleness" column)
    clock: int | None = None
    min_clock: int | None = None
    dropped: bool | None = None  # k-of-n / backup tasks: this gradient was late or a duplicate, not applied
    backup: bool | None = None  # backup tasks: this portion was a speculative copy of one already running
    period: int | None = None  # local SGD, DiLoCo: steps in the averaging period this step belongs to
    averaging_round: int | None = None  # local SGD: averaging rounds completed after this step
    nonfinite: bool | None = None  # the loss, gradient or average was not finite: skipped (or the run stopped)
    bytes_uncompressed: int | None = None  # --compress: what bytes_sent would have been in float32
    lr: float | None = None  # the rate the update was applied at, where the strategy set its own (elastic BSP)
    extra: dict[str, Any] = field(default_factory=dict)  # the strategy's own `metric_columns`, by name

    def add(self, traffic: Traffic) -> CommStats:
        """Count a channel transfer's seconds and bytes on this row (returns the row). `bytes_uncompressed`
        appears once any transfer ran under a codec, float32 transfers counting as they were sent."""
        if traffic.uncompressed is not None or self.bytes_uncompressed is not None:
            mine = self.bytes_sent if self.bytes_uncompressed is None else self.bytes_uncompressed
            theirs = traffic.sent if traffic.uncompressed is None else traffic.uncompressed
            self.bytes_uncompressed = mine + theirs
        self.seconds += traffic.seconds
        self.bytes_sent += traffic.sent
        self.bytes_received += traffic.received
        return self


class Strategy(ABC):
    name: ClassVar[str]
    summary: ClassVar[str] = ""  # one line for `distrain strategies`
    transports: ClassVar[tuple[str, ...]] = ("collective",)
    Options: ClassVar[type[StrategyOptions]] = NoOptions
    # Updates skipped for fp16's loss-scale overflow so far (`usable_gradient`): the worker marks those
    # steps' rows `overflow`, which never count as divergence (orchestrator/outcome.py).
    overflow_skips: int = 0
    independent_workers: ClassVar[bool] = False
    # A step is one pass over the whole training set (Sandblaster): one step per epoch, units run by `run_unit`.
    full_batch: ClassVar[bool] = False
    # Its driver-side actor hands a lost worker's outstanding work out again (`worker_lost(rank)`), so a
    # dead worker is replaced in place even with --backup-tasks (orchestrator/replacement.py).
    reissues_lost_work: ClassVar[bool] = False
    # Its workers can read a streamed data set (a Ray Data `Dataset`, orchestrator/streaming.py): each takes
    # the next batch of its own shard, in order, one per unit of a fixed work plan. False for every strategy
    # that assigns samples by index (shared plans, portions handed out, re-dealt units, full passes).
    streams_data: ClassVar[bool] = False
    # Its membership can change mid-run (`--workers MIN..MAX`, orchestrator/membership.py): a joiner takes
    # everything it needs from live actors, a leaver's unfinished units go to the others.
    elastic: ClassVar[bool] = False
    # The transports under which `implementation(config)` is elastic, where that is not the class itself
    # (BSP: over the collective transport), for the refusal's list of what takes a range.
    elastic_transports: ClassVar[tuple[str, ...]] = ()
    # Run settings whose default differs under this strategy (DiLoCo's smaller inner --lr), applied only
    # where the user set none; a schedule's phases share the run's settings, set by its first strategy.
    run_defaults: ClassVar[dict[str, Any]] = {}
    metric_columns: ClassVar[dict[str, str]] = {}  # column -> Arrow type: "float64", "int64", "int32", "bool"
    # What `--compress` compresses under this strategy, for `distrain strategies` ("": it cannot apply one,
    # e.g. its traffic does not go through its channel). By default: the streams it sends on its channel.
    compresses: ClassVar[str] = "what it sends on its channel (float32 where a stream is declared exact)"
    _channel: Channel | None = None  # see `channel`
    # The options the report's strategy column states (`settings_text`, `run_settings_text`), so its
    # "settings that differ" leaves them out (reporting/report.py).
    described_options: ClassVar[tuple[str, ...]] = ()
    # The options the planner's step-time model sets for this strategy (planning/planner.py).
    planning: ClassVar[tuple[PlanningSetting, ...]] = ()
    # The options `distrain tune` sweeps with a flag of their own (option -> the flag's help, e.g.
    # --staleness 0,2,8); any other option is swept with --param NAME=VALUES.
    sweep_flags: ClassVar[dict[str, str]] = {}

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        self.config = config
        self.ctx = ctx
        self.options: Any = config.options_of(self.name)

    @property
    def channel(self) -> Channel:
        """This worker's channel (strategies/channel.py): every transfer to the other workers and to the
        shards, under the run's codec, emulated link and byte accounting. Made on first use."""
        if self._channel is None:
            from distrain.strategies.channel import Channel

            self._channel = Channel(self.config, self.ctx)
        return self._channel

    @classmethod
    def driver_actors(cls, config: RunConfig) -> tuple[DriverActor, ...]:
        """The driver-side actors this run (or phase) of the strategy needs, in the order they start: specs
        (strategies/driver_actor.py) the controller starts before the workers set up. By default the
        parameter-server shards under the strategy's rule, where it has one; an override adds its own."""
        rule = cls.implementation(config).ps_rule(config)
        return (ps_shards(rule),) if rule is not None else ()

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        """Figures for summary.json from the run's step rows (columns, this strategy's included)."""
        return {}

    @classmethod
    def keeps_own_books(cls, config: RunConfig) -> bool:
        """Whether this run of it keeps books of the work (who computed which portion, which gradients a
        round took) that replacing a worker in place would upset (the failure policy's `own_books`)."""
        return False

    @classmethod
    def settings_text(cls, config: dict[str, Any]) -> str:
        """What the report shows right after the strategy's name, for the run or one phase of its schedule
        (" s=2", " tau=8 adaptive (10%, max 16)"), from a run's flat config.yaml values (any may be absent:
        a run of an earlier version)."""
        return ""

    @classmethod
    def run_settings_text(cls, config: dict[str, Any]) -> str:
        """What the report shows at the end for the run's own strategy, never a schedule's phase
        (" staleness-lr", " backup-workers=1")."""
        return ""

    @classmethod
    def actor_figures(cls, config: RunConfig, actors: dict[str, Any]) -> dict[str, Any]:
        """Figures for summary.json that its driver-side actors hold, asked once the run is over
        (`actors`: their handles by spec name, e.g. "ps_shards" (strategies/ps_shard_group.py's ShardGroup))."""
        return {}

    @classmethod
    def implementation(cls, config: RunConfig) -> type[Strategy]:
        """The class that runs on the workers for this config (e.g. BSP over the PS transport)."""
        return cls

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule | None:
        """The shards' rule, for strategies on the parameter-server transport; None otherwise."""
        return None

    @classmethod  # noqa: B027 - optional hook
    def check_model(cls, config: RunConfig, tensor_sizes: list[int]) -> None:
        """Refuse (ConfigError) a config this strategy cannot run on the model, whose trainable tensors
        have `tensor_sizes` values each; called before anything starts (`distrain run`, each trial)."""

    @classmethod  # noqa: B027 - optional hook
    def check_data(cls, config: RunConfig, num_samples: int) -> None:
        """Refuse (ConfigError) a config this strategy cannot run on `num_samples` training samples
        (sandblaster: more portions per pass than samples); called with `check_model`."""

    @classmethod
    def check_codec(cls, config: RunConfig, codec: CodecSpec) -> None:
        """Refuse (ConfigError, one line) a `--compress` codec this strategy's traffic cannot carry."""
        if not cls.compresses:
            raise ConfigError(f"--strategy {cls.name} does not apply {FLAG}; drop {FLAG} {codec}")

    def setup(self, trainer: LocalTrainer) -> None:  # noqa: B027 - optional hook
        """Join transports; every worker calls this at the same time."""

    @property
    def slices_per_step(self) -> int:
        """Equal parts a step's samples are cut into; a work unit's slice picks one."""
        return self.ctx.world_size

    @property
    def share_cut(self) -> int:
        """Under unequal shares, the consecutive slices one share is cut equally into: 1 (a share per
        slice); a cut replica's data-parallel ranks split its one share (strategies/sharded_bsp.py)."""
        return 1

    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        """The (epoch, step, slice) units this worker actually computes, in order, out of a segment's.

        Lock-step strategies compute them all; k-of-n skips rounds that closed without this worker;
        backup tasks replace them with the portions a scheduler hands out.
        """
        yield from units

    def unit_slices(self, slice_: int) -> range:
        """The slices of the step that the unit `plan` just yielded with `slice_` covers, read and computed as
        one batch: that slice alone (backup tasks: a chunk of portions in a row)."""
        return range(slice_, slice_ + 1)

    def run_unit(self, trainer: LocalTrainer, reader: Any, global_step: int) -> tuple[float, int] | None:
        """Compute global step `global_step`'s unit this strategy's own way, returning (the loss to
        record, samples this worker read); None (the default): the worker computes the unit's batch
        gradient itself. `reader` reads training samples by index (`trainers.task.BatchReader`)."""
        return None

    @property
    def counts_samples(self) -> bool:
        """Whether this worker's rows count its batch's samples (a pipeline's S stages share one batch:
        only the last stage counts it)."""
        return True

    def compute_gradients(self, trainer: LocalTrainer, batch: Any) -> float:
        """Forward and backward of one batch into `trainer.grads_flat`; returns the loss (a pipeline
        runs its schedule here)."""
        return trainer.compute_gradients(batch)

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """Heterogeneous shares (docs/heterogeneous.md): this worker's next gradient is the mean over
        `samples` of the step's `step_samples`. By default the channel weights it by b_i * N / B on its way
        out, so the mean over the N workers is the whole batch's mean gradient."""
        from distrain.trainers.shares import gradient_weight

        self.channel.gradient_weight = gradient_weight(samples, self.slices_per_step, step_samples)

    def eval_share(self, shard: int, num_shards: int) -> tuple[int, int]:
        """Which share of the test set worker `shard` of `num_shards` scores: (share, shares)."""
        return shard, num_shards

    def evaluate(self, trainer: LocalTrainer, batches: Iterator[Any]) -> dict[str, tuple[float, float]]:
        """(sum, count) of the task's loss and metrics over `batches` (see `trainers/task.py`)."""
        return trainer.evaluate(batches)

    def finite(self, ok: bool, what: str) -> bool:
        """--on-nonfinite: True to go on with the update; False to skip it (skip); raises NonFinite (stop)."""
        if ok:
            return True
        if self.config.on_nonfinite == "stop":
            raise NonFinite(what)
        return False

    def usable_gradient(self, trainer: LocalTrainer, what: str, check_loss: bool = False) -> bool:
        """Whether this step's update goes ahead with the gradient in `trainer.grads_flat` (unscaled here
        under --precision fp16). Call it on the gradient the update uses: the all-reduced one (every replica
        decides alike), or the local one before a push or local step (`check_loss`: this replica's loss too).

        Under fp16 a non-finite gradient is the loss scale's overflow: the update is skipped and the scale
        halved, as torch.amp.GradScaler does, whatever --on-nonfinite says, until the scale has fallen below
        1 (no scale helps: divergence, handled by --on-nonfinite)."""
        trainer.unscale_grads_()
        ok = all_finite(trainer.grads_flat) and (not check_loss or math.isfinite(trainer.last_loss))
        return self.gradient_decision(trainer.scaler, ok, what)

    def gradient_decision(self, scaler: LossScaler | None, ok: bool, what: str) -> bool:
        """`usable_gradient`'s decision once finiteness is known (`ok`): under fp16 (`scaler`) a non-finite
        gradient is an overflow (skipped, the scale halved) until the scale is exhausted; otherwise
        --on-nonfinite decides. A strategy whose workers hold pieces of the gradient (sharded replicas)
        agrees `ok` over them first, so every worker updates its scale alike."""
        if scaler is not None:
            scaler.update(overflow=not ok)
            if not ok and not scaler.exhausted:
                self.overflow_skips += 1
                return False
        return self.finite(ok, what)

    @abstractmethod
    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        """Communicate the gradient in `trainer.grads_flat` and update the parameters."""

    def settle(self, rows: dict[str, list[Any]]) -> None:  # noqa: B027 - optional hook
        """At the end of a segment: fill in what was not known when its rows were written (the
        rows are columns, one entry per computed unit, in order)."""

    def at_epoch_end(self, trainer: LocalTrainer) -> CommStats | None:
        """Called on every worker right after its last step of an epoch (and of the run), and of a span
        ending in a step checkpoint (--checkpoint-steps), before any evaluation, checkpoint or strategy
        switch reads the replica; returns what it communicated."""
        return None

    def prepare_eval(self, trainer: LocalTrainer) -> None:  # noqa: B027 - optional hook
        """Make the replica hold the parameters to evaluate."""

    def export_state(self, trainer: LocalTrainer) -> dict[str, Any]:
        """The state to checkpoint: model state dict and flat optimizer state."""
        return trainer.state_dict()

    def checkpoint_shards(self, trainer: LocalTrainer, step: int, directory: Path) -> ShardsSaved | None:
        """Called on every worker after the step a checkpoint follows (`step` steps done). A strategy
        whose workers write their own shards (sharded replicas) begins that here, in `directory`, and
        says what it began; None (the rule): the driver writes the checkpoint from the state
        `export_state` gives."""
        return None

    def extra_state(self) -> dict[str, Any] | None:
        """State of the strategy's own that a checkpoint keeps (asked of every worker; None: nothing),
        beyond the model and optimizer state `export_state` gives."""
        return None

    def load_extra_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore what `extra_state` gave, after `setup`, when a run resumes (or recovers) from a checkpoint."""

    def teardown(self) -> None:
        """Leave transports (the channel's group; an override calls this too)."""
        if self._channel is not None:
            self._channel.close()
