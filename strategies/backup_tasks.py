"""BSP over the parameter server with speculative backup tasks (DistBelief Sandblaster, MapReduce).

Each round's global batch is cut into P > N equal portions. Workers ask the orchestrator's portion
scheduler for work as they free up; once every portion of the round is handed out, an idle worker
gets a copy of one still outstanding (see `orchestrator/backup_tasks.py`). The shards keep the first
gradient of each portion and drop copies ("portions" rule in `ps_shard.py`), then apply the mean of
the P portion gradients: the mean gradient of the global batch, whoever computed which portion.

A worker pushes a portion without waiting for the round; it pulls θ only when its next portion
belongs to a newer round than the θ it holds. The request for the next portion goes out together
with the push, carrying the push's object refs: the scheduler counts the portion done once the
shards have it, and the worker waits for one round trip, not two.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import ray

from distrain.config import RunConfig
from distrain.strategies.base import CommStats, StrategyContext
from distrain.strategies.ps import PSStrategy
from distrain.strategies.ps_shard import ConsistencyRule
from distrain.trainers.local_trainer import LocalTrainer


class BSPBackupTasks(PSStrategy):
    name = "bsp"

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        assert ctx.portion_scheduler is not None, "backup tasks need the orchestrator's portion scheduler"
        self.scheduler = ctx.portion_scheduler
        self.trainer: LocalTrainer | None = None
        self.held = 0  # shard version of the θ this replica holds
        self.current: Any = None  # the Assignment being computed
        self.next_request: Any = None  # ref of the request for the next portion, sent with the last push
        self.upto: tuple[int, int] = (0, 0)  # (epoch, step) of the current segment's last round
        self.waited = 0.0  # seconds spent waiting for θ of the current portion's round
        self.received = 0  # bytes of θ pulled for the current portion

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        assert config.portions is not None
        return ConsistencyRule.backup_tasks(config.portions)

    @property
    def slices_per_step(self) -> int:
        assert self.config.portions is not None
        return self.config.portions

    def setup(self, trainer: LocalTrainer) -> None:
        self.trainer = trainer
        super().setup(trainer)
        self.held = min(self.client.read_versions)  # not 0 after a restore: the shards' counters go on

    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        """Portions from the scheduler until the segment's last round is through."""
        assert self.trainer is not None
        if not units:
            return
        self.upto = units[-1][0], units[-1][1]
        while True:
            if self.next_request is None:
                self.next_request = self._request(None)
            assignment = ray.get(self.next_request)
            self.next_request = None
            if assignment is None:
                return
            self.waited, self.received = 0.0, 0
            if assignment.tag > self.held:
                self.received = self.trainer.nbytes
                self.waited, versions = self.client.pull_at(assignment.tag, self.trainer.params_flat.numpy())
                self.held = min(versions)
                if max(versions) > assignment.tag:
                    # The round closed while we were told to help (some shard already applied it):
                    # this θ may mix two versions, so computing on it is pointless at best.
                    continue
            self.current = assignment
            yield assignment.epoch, assignment.step, assignment.portion

    def _request(self, finished: tuple[int, int, list[Any]] | None) -> Any:
        return self.scheduler.acquire.remote(self.ctx.rank, finished, *self.upto)

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        a = self.current
        t0 = time.perf_counter()
        pushes = self.client.push_portion_async(a.tag, a.portion, trainer.grads_flat.numpy(), lr)
        self.next_request = self._request((a.tag, a.portion, pushes))
        counted = ray.get(pushes)[0]  # copies of a portion are identical: shard 0's verdict is the row's
        seconds = time.perf_counter() - t0
        return CommStats(
            seconds=seconds + self.waited,
            bytes_sent=trainer.nbytes,
            bytes_received=self.received,
            wait_s=self.waited,
            read_version=a.tag,
            applied_version=a.tag if counted else None,
            staleness=0,
            dropped=not counted,
            backup=a.copy,
        )
