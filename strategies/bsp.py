"""BSP: every step, every replica applies the mean of all workers' gradients.

Two transports: the collective one (all-reduce of the flat gradient, then a local optimizer step on
every replica) and the parameter server (the shards apply the round's mean and serve θ_{t+1}).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError
from distrain.fields import setting
from distrain.strategies.base import CommStats, PlanningSetting, Strategy, StrategyContext, StrategyOptions
from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.driver_actor import DriverActor
from distrain.strategies.elastic_group import GroupBroken, ReformedGroup, lr_factor
from distrain.strategies.ps import PSStrategy
from distrain.strategies.strategy_names import STRATEGIES

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.strategies.channel import GradientReduce
    from distrain.strategies.ps_client import PushPullResult
    from distrain.trainers.local_trainer import LocalTrainer


# One flag, two strategies (an option name means one thing across strategies): both hand out portions.
BACKUP_TASKS_HELP = (
    "bsp over ps: split each round into --portions, handed out in chunks by each worker's measured pace (a "
    "worker measured slow gets none) and copied to idle workers when a copy would finish first; "
    "sandblaster: copy a pass's outstanding portions to idle workers."
)


@dataclass(frozen=True)
class BSPOptions(StrategyOptions):
    """Straggler mitigation of BSP rounds on the parameter server (section "stragglers")."""

    backup_workers: int = setting(
        0,
        "k-of-n BSP (bsp over ps): start b extra workers; each round applies the first --workers gradients.",
        "stragglers",
    )
    backup_tasks: bool = setting(False, BACKUP_TASKS_HELP, "stragglers")
    portions: int | None = setting(
        None, "Portions per round; default 2 x --workers (bsp --transport ps --backup-tasks).", "stragglers"
    )

    def resolved(self, run: RunConfig) -> BSPOptions:
        if self.backup_tasks and self.portions is None:  # under a range: 2 x MAX
            return dataclasses.replace(self, portions=2 * run.worker_slots)
        return self

    def extra_replicas(self, run: RunConfig) -> int:
        """k-of-n: b backup workers beyond --workers (under a range the backups are among the MAX)."""
        return 0 if run.elastic else self.backup_workers

    def check(self, run: RunConfig) -> None:
        """Backup workers and backup tasks are ways of running BSP rounds on the parameter server."""
        if self.backup_workers < 0:
            raise ConfigError(f"--backup-workers must be >= 0, got {self.backup_workers}")
        flags = (("--backup-workers", self.backup_workers), ("--backup-tasks", self.backup_tasks))
        wanted = [name for name, on in flags if on]
        if wanted and run.schedule:
            raise ConfigError(f"{wanted[0]} cannot be combined with --schedule; drop one of them")
        if wanted and run.transport != "ps":
            raise ConfigError(
                f"{wanted[0]} needs synchronous rounds on the parameter server: use --strategy bsp --transport ps"
            )
        if len(wanted) == 2:
            raise ConfigError("--backup-workers and --backup-tasks are alternatives; choose one")
        if self.backup_workers and run.elastic and run.workers - self.backup_workers < 1:
            # Under a range the b backups are among the members: each round applies k = members - b.
            raise ConfigError(
                f"--workers {run.workers}..{run.max_workers} with --backup-workers {self.backup_workers}: each "
                f"round applies members - {self.backup_workers} gradients, none at MIN {run.workers}; raise MIN "
                f"above {self.backup_workers}"
            )
        if self.portions is not None and not self.backup_tasks:
            raise ConfigError("--portions splits rounds for --backup-tasks; add --backup-tasks or drop it")
        if self.backup_tasks:
            assert self.portions is not None
            if self.portions <= run.worker_slots:
                what = f"the MAX of --workers ({run.worker_slots})" if run.elastic else f"--workers ({run.workers})"
                raise ConfigError(f"--portions ({self.portions}) must exceed {what} so free workers can take more")
            if run.global_batch_size % self.portions:
                raise ConfigError(
                    f"--portions {self.portions} does not divide the global batch {run.global_batch_size} "
                    "(--workers x --batch-size) into equal portions"
                )


@STRATEGIES.register("bsp", "bulk synchronous: mean gradient every step (all-reduce, or --transport ps)")
class BSP(Strategy):
    name = "bsp"
    transports = ("collective", "ps")
    streams_data = True  # over the collective, one replica a worker (orchestrator/streaming.py)
    Options = BSPOptions
    compresses = "the gradient all-reduce (collective); gradient pushes (ps)"
    # --workers MIN..MAX: ElasticBSP over the collective (below), BSPOverPS and
    # BSPBackupTasks over the PS (rounds of the current members)
    elastic_transports = ("collective", "ps")
    described_options = ("backup_workers", "backup_tasks", "portions")
    planning = (PlanningSetting("backup_workers", "backups", 0),)

    @classmethod
    def keeps_own_books(cls, config: RunConfig) -> bool:
        options = config.options_of(cls.name)
        return bool(options.backup_workers or options.backup_tasks)

    @classmethod
    def run_settings_text(cls, config: dict[str, Any]) -> str:
        text = f" backup-workers={config['backup_workers']}" if config.get("backup_workers") else ""
        if config.get("backup_tasks"):
            text += " backup-tasks" + (f" portions={config['portions']}" if config.get("portions") else "")
        return text

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.grads: GradientReduce | None = None

    @classmethod
    def implementation(cls, config: RunConfig) -> type[Strategy]:
        if config.pipelined and config.sharded:  # stages sharded over --fsdp D
            from distrain.strategies.sharded_pipeline import ShardedPipelineBSP

            return ShardedPipelineBSP
        if config.pipelined:
            from distrain.strategies.pipeline import PipelineBSP

            return PipelineBSP
        if config.sharded and config.transport == "ps" and config.options_of("bsp").backup_tasks:
            from distrain.strategies.sharded_backup_tasks import ShardedBackupTasks  # a replica takes each chunk

            return ShardedBackupTasks
        if config.sharded and config.transport == "ps":  # worker (r, d) pushes its FSDP chunks to PS shard d (or t)
            from distrain.strategies.sharded_ps import ShardedBSPOverPS

            return ShardedBSPOverPS
        if config.sharded and config.elastic:  # --workers MIN..MAX: whole replicas join and leave
            from distrain.strategies.elastic_sharded_bsp import ElasticShardedBSP

            return ElasticShardedBSP
        if config.sharded:
            from distrain.strategies.sharded_bsp import ShardedBSP

            return ShardedBSP
        if config.transport != "ps":
            if config.elastic:  # --workers MIN..MAX: a group re-formed as members come and go
                return ElasticBSP
            return cls
        if config.options_of("bsp").backup_tasks:
            from distrain.strategies.backup_tasks import BSPBackupTasks

            return BSPBackupTasks
        return BSPOverPS

    @classmethod
    def driver_actors(cls, config: RunConfig) -> tuple[DriverActor, ...]:
        if config.transport != "ps":
            return ()
        shards = super().driver_actors(config)
        if config.options_of("bsp").backup_tasks:
            from distrain.strategies.portion_scheduler import portion_scheduler

            return (*shards, portion_scheduler(cls.implementation(config).ps_rule(config)))
        return shards

    @classmethod
    def actor_figures(cls, config: RunConfig, actors: dict[str, Any]) -> dict[str, Any]:
        """Backup workers and backup tasks, and an elastic run (--workers MIN..MAX): gradients dropped per
        worker, rounds applied, how many gradients (k-of-n, elastic: the members of each round) or portions
        (backup tasks) each update averaged, copies issued."""
        options = config.options_of("bsp")
        figures: dict[str, Any] = {}
        if (options.backup_workers or options.backup_tasks or config.elastic) and "ps_shards" in actors:
            stats = actors["ps_shards"].stats()
            # Shards decide independently; shard 0's count is each worker's (they see the same pushes).
            # Across cut replicas (--fsdp D) a client is a replica, and the shards decide together
            # (ps_shard.RoundReferee; under a range too): `rounds_shards_disagree` counts the rounds whose
            # members differ between shards (0 by construction; the record that says so).
            figures["dropped_gradients"] = {str(w): n for w, n in enumerate(stats[0]["dropped"])}
            members = stats[0]["round_members"]
            figures["rounds_applied"] = len(members)
            sizes = Counter(len(m) for m in members)
            figures["gradients_per_update"] = {str(k): v for k, v in sorted(sizes.items())}
            if config.sharded and (options.backup_workers or config.elastic):  # (the PS's: "ps_shards" above)
                figures["rounds_shards_disagree"] = rounds_disagreeing([s["round_members"] for s in stats])
        if "portion_scheduler" in actors:
            import ray

            stats = ray.get(actors["portion_scheduler"].stats.remote())
            figures |= {f"backup_{k}": v for k, v in stats.items()}
        return figures

    def setup(self, trainer: LocalTrainer) -> None:
        self.channel.join()
        # Replicas start equal because the seed fixes the init; the broadcast makes it a fact.
        self.channel.broadcast(trainer.params_flat, src=0)
        # Launched bucket by bucket during backward; under --compress the whole gradient goes through the
        # codec after backward instead (the channel decides: PowerSGD needs every matrix whole).
        self.grads = self.channel.gradient_all_reduce("grads", trainer.params, trainer.grads_flat)

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        assert self.grads is not None, "setup() must run before step()"
        traffic = self.grads.finish()
        # Decided on the all-reduced gradient, which every replica holds: all skip (or stop) together.
        applied = self.usable_gradient(trainer, "all-reduced gradient")
        if applied:
            trainer.apply_update(lr)
        return CommStats(nonfinite=None if applied else True).add(traffic)

    def teardown(self) -> None:
        if self.grads is not None:
            self.grads.remove()
            self.grads = None
        super().teardown()


def rounds_disagreeing(per_shard: list[list[list[int]]]) -> int:
    """Rounds whose members differ between shards (each shard's `round_members`; a round one shard
    applied and another did not counts too)."""
    rounds = max((len(r) for r in per_shard), default=0)
    return sum(1 for i in range(rounds) if len({tuple(r[i]) if i < len(r) else None for r in per_shard}) > 1)


class BSPOverPS(PSStrategy):
    """BSP rounds on the shards; with backup workers, k-of-n rounds (the first --workers gradients).

    Under --workers MIN..MAX a round is the current members' (`ParameterShard.set_round_members`):
    units are shared (whoever asks), each member pushes one unit's gradient per round, so the global
    batch is members x B and the shards rescale the rate for it. A member enters at the round the
    driver names (a joiner from its setup, one fed again after it had no work at the start of its
    segment), and under k-of-n a late member does not skip units: its next unit is computed on the
    θ its dropped push brought back, so every unit is still computed once.
    """

    name = "bsp"
    elastic = True  # see the class docstring; the collective BSP is not (its class declares no range)

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.skip = 0  # units of the current segments whose rounds closed without this worker
        self.trainer: LocalTrainer | None = None

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        backups = config.options_of("bsp").backup_workers
        if config.elastic:
            return ConsistencyRule.elastic_bsp(backups, config.lr_scaling, config.worker_slots)
        return ConsistencyRule.bsp(accept=config.workers if backups else None)

    def setup(self, trainer: LocalTrainer) -> None:
        super().setup(trainer)
        self.trainer = trainer
        # A replacement whose dead predecessor already pushed for the open round starts at the next
        # one: it waits for that round to close (the others' pushes close it) and takes its θ.
        if self.clock > min(self.client.read_versions):
            host = self.staging(trainer)
            self.client.pull_at(self.clock, host.params_out())
            host.install()

    def _advance(self, result: PushPullResult) -> None:
        # The next round is the least version any shard is at. Under k-of-n, rounds that closed
        # without this worker (its gradient came late) are skipped, together with their data
        # (elastic: not skipped, the units are shared and each is computed once).
        if not self.config.elastic:
            self.skip += result.version - (self.clock + 1)
        self.clock = result.version

    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        if self.config.elastic and units:
            # Fed again after the rounds went on without it: the driver entered it at a later round.
            import ray

            trainer = self.trainer
            entry = max(ray.get([s.clock_of.remote(self.ctx.rank) for s in self.client.shards]))
            if entry > self.clock and trainer is not None:
                host = self.staging(trainer)
                self.client.pull_at(entry, host.params_out())
                host.install()
                self.clock = entry
            # Its θ may be newer than its clock: an evaluation or checkpoint pulled it in between, or
            # (k-of-n) the rounds it entered at closed without it. It pushes for the round of that θ.
            self.clock = max(self.clock, min(self.client.read_versions))
        for unit in units:
            if self.skip > 0:
                self.skip -= 1
                continue
            yield unit


class ElasticBSP(ReformedGroup, BSP):
    """BSP over the collective transport whose group can change size between rounds."""

    elastic = True
    metric_columns = {"members": "int32"}  # the group's size when the row's round ran

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.weight = 0.0  # this member's share of the round: 1 for a unit, 0 sitting one out
        self.unit_weight = 1.0  # a unit's weight: 1, or under --balance speed its b_i x MAX / B

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """--balance speed under a range: a round is one whole step of B samples cut by the members' shares
        (orchestrator/rounds.py StepRoundPlan). Weighted b_i x MAX / B, a round's weights add up to MAX, so
        it is applied as a full round of MAX units (the rate unscaled) and the mean is Σ b_i g_i / B."""
        from distrain.trainers.shares import gradient_weight

        self.unit_weight = gradient_weight(samples, self.slices_per_step, step_samples)

    @classmethod
    def block_rounds(cls, config: RunConfig) -> int:
        """Rounds the driver deals at a time (between two boundaries where the group may change)."""
        return config.segment_steps

    @property
    def slices_per_step(self) -> int:
        return self.config.worker_slots  # a step is MAX slices whatever the membership

    def setup(self, trainer: LocalTrainer) -> None:
        """No group yet: the driver forms one among the members (`reform`) before the first round."""

    def reformed(self, trainer: LocalTrainer) -> None:
        """After a re-form's broadcast (nothing of BSP's own depends on the state)."""

    def compute_gradients(self, trainer: LocalTrainer, batch: object) -> float:
        self.weight = self.unit_weight
        return super().compute_gradients(trainer, batch)

    def sit_out(self, trainer: LocalTrainer) -> None:
        """This member has no unit in this round: it joins the all-reduce with nothing to add."""
        self.weight = 0.0
        trainer.grads_flat.zero_()
        # Under fp16 every replica must unscale after the all-reduce alike (`usable_gradient`).
        trainer._grads_scaled = trainer.scaler is not None

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        import torch

        assert self.channel.joined, "reform() must run before step()"
        size = self.channel.world_size
        n = trainer.grads_flat.numel()
        buffer = torch.empty(n + 2, dtype=trainer.grads_flat.dtype, device=trainer.grads_flat.device)
        buffer[:n].copy_(trainer.grads_flat)
        if self.weight not in (0.0, 1.0):  # an unequal share's gradient (a sit-out's is zero already)
            buffer[:n].mul_(self.weight)
        buffer[n], buffer[n + 1] = self.weight, lr * self.weight
        try:
            traffic = self.channel.all_reduce("grads", buffer, op="sum")
        except (RuntimeError, OSError) as e:  # gloo: a closed peer, or the group's timeout
            raise GroupBroken(str(e)) from e
        units = int(round(float(buffer[n])))
        if units == 0:  # nobody had a unit (never dealt so): nothing to apply
            return CommStats(seconds=traffic.seconds, extra={"members": size})
        trainer.grads_flat.copy_(buffer[:n]).div_(units)
        rate = float(buffer[n + 1]) / units
        rate *= lr_factor(
            units, self.config.worker_slots, self.config.batch_size, self.config.base_batch_size, self.config.lr_scaling
        )
        applied = self.usable_gradient(trainer, "all-reduced gradient")
        if applied:
            trainer.apply_update(rate)
        return CommStats(
            nonfinite=None if applied else True,
            lr=rate if math.isfinite(rate) else None,
            extra={"members": size},
        ).add(traffic)
