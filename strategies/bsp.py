"""BSP: every step, every replica applies the mean of all workers' gradients.

Two transports: the collective one (all-reduce of the flat gradient, then a local optimizer step on
every replica) and the parameter server (the shards apply the round's mean and serve θ_{t+1}).
"""

from __future__ import annotations

from collections.abc import Iterator

from distrain.config import RunConfig
from distrain.strategies.base import CommStats, Strategy, StrategyContext, all_finite
from distrain.strategies.collective import CollectiveGroup, OverlappedAllReduce, ring_allreduce_bytes
from distrain.strategies.ps import PSStrategy
from distrain.strategies.ps_client import PushPullResult
from distrain.strategies.ps_shard import ConsistencyRule
from distrain.strategies.registry import STRATEGIES
from distrain.trainers.local_trainer import LocalTrainer


@STRATEGIES.register("bsp", "bulk synchronous: mean gradient every step (all-reduce, or --transport ps)")
class BSP(Strategy):
    name = "bsp"
    transports = ("collective", "ps")

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.group: CollectiveGroup | None = None
        self.overlap: OverlappedAllReduce | None = None

    @classmethod
    def implementation(cls, config: RunConfig) -> type[Strategy]:
        if config.transport != "ps":
            return cls
        if config.backup_tasks:
            from distrain.strategies.backup_tasks import BSPBackupTasks

            return BSPBackupTasks
        return BSPOverPS

    def setup(self, trainer: LocalTrainer) -> None:
        backend = "nccl" if self.ctx.device.startswith("cuda") else "gloo"
        delay_s = self.config.comm_delay_ms / 1000
        self.group = CollectiveGroup(
            self.ctx.rank, self.ctx.world_size, self.ctx.rendezvous, backend, self.config.collective_timeout_s, delay_s
        )
        # Replicas start equal because the seed fixes the init; the broadcast makes it a fact.
        self.group.broadcast_(trainer.params_flat, src=0)
        if self.ctx.world_size > 1:
            self.overlap = OverlappedAllReduce(trainer.params, trainer.grads_flat, self.ctx.world_size, delay_s=delay_s)

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        assert self.group is not None, "setup() must run before step()"
        # The buckets' all-reduces were launched during backward; comm_s is what is left to wait for.
        seconds = self.overlap.finish() if self.overlap else self.group.all_reduce_mean_(trainer.grads_flat)
        # Decided on the all-reduced gradient, which every replica holds: all skip (or stop) together.
        applied = self.finite(all_finite(trainer.grads_flat), "all-reduced gradient")
        if applied:
            trainer.apply_update(lr)
        moved = ring_allreduce_bytes(trainer.nbytes, self.ctx.world_size)
        return CommStats(seconds=seconds, bytes_sent=moved, bytes_received=moved, nonfinite=None if applied else True)

    def teardown(self) -> None:
        if self.overlap is not None:
            self.overlap.remove()
            self.overlap = None
        if self.group is not None:
            self.group.destroy()
            self.group = None


class BSPOverPS(PSStrategy):
    """BSP rounds on the shards; with backup workers, k-of-n rounds (the first --workers gradients)."""

    name = "bsp"

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.skip = 0  # units of the current segments whose rounds closed without this worker

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        return ConsistencyRule.bsp(accept=config.workers if config.backup_workers else None)

    def setup(self, trainer: LocalTrainer) -> None:
        super().setup(trainer)
        # A replacement whose dead predecessor already pushed for the open round starts at the next
        # one: it waits for that round to close (the others' pushes close it) and takes its θ.
        if self.clock > min(self.client.read_versions):
            self.client.pull_at(self.clock, trainer.params_flat.numpy())

    def _advance(self, result: PushPullResult) -> None:
        # The next round is the least version any shard is at. Under k-of-n, rounds that closed
        # without this worker (its gradient came late) are skipped, together with their data.
        self.skip += result.version - (self.clock + 1)
        self.clock = result.version

    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        for unit in units:
            if self.skip > 0:
                self.skip -= 1
                continue
            yield unit
