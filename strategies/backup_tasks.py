"""BSP over the parameter server with speculative backup tasks (DistBelief Sandblaster, MapReduce).

Each round's global batch is cut into P > N equal portions. Workers ask the orchestrator's portion
scheduler for work as they free up; once every portion of the round is handed out, an idle worker
gets a copy of one still outstanding (see `strategies/portion_scheduler.py`). The shards keep the first
gradient of each portion and drop copies ("portion-rounds" rule in `ps_shard.py`), then apply the mean of
the P portion gradients: the mean gradient of the global batch, whoever computed which portion.

The scheduler hands out chunks: portions in a row that the worker reads and computes as one batch and
pushes as one gradient (the mean over the chunk's samples; the shards weigh it by its portions). It
sizes them so that, without a straggler, each worker takes its P / N portions as one chunk (plain BSP's
work), gives no share to a worker it measured slow, and copies only where a copy is expected to finish
first (`PortionScheduler`). Rows stay one per portion (`settle`): a chunk's rows share its times and
samples equally, and its bytes are on the first.

A worker pushes a chunk without waiting for the round, or even for the push: the request for its
next chunk goes out together with the push, carrying the push's object refs, and the scheduler
counts the chunk done once the shards have it. While the push travels the worker computes its
next chunk (same round, same θ), so per chunk it waits for one round trip to the scheduler.
It pulls θ only when its next chunk belongs to a newer round than the θ it holds, and asks for the
next round's θ together with its push (the shards answer when that round is applied, while the
scheduler is still learning of it), so a round's θ is usually there when its first chunk is.
Whether a pushed copy was the one the shards kept is learned at the end of the segment (`settle`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ray

from distrain.compression.spec import FLAG
from distrain.errors import ConfigError
from distrain.strategies.base import CommStats, StrategyContext
from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.ps import PSStrategy
from distrain.trainers.local_trainer import LocalTrainer

if TYPE_CHECKING:
    from distrain.compression import CodecSpec
    from distrain.config import RunConfig


class BSPBackupTasks(PSStrategy):
    compresses = ""  # a portion's gradient goes out whole
    # Under --workers MIN..MAX portions go to whoever asks, so whoever is a member; a leaver's are handed
    # out again (`PortionScheduler.worker_lost`). A round is always the whole global batch (MAX x B in P
    # portions): the membership changes how fast rounds go, not what they are, so the rate stays.
    elastic = True

    @classmethod
    def check_codec(cls, config: RunConfig, codec: CodecSpec) -> None:
        raise ConfigError(f"{FLAG} does not apply to --backup-tasks portions; drop {FLAG} {codec} or the backup tasks")

    name = "bsp"

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        assert "portion_scheduler" in ctx.driver_actors, "backup tasks need the driver's portion scheduler"
        self.scheduler = ctx.driver_actors["portion_scheduler"]
        self.trainer: LocalTrainer | None = None
        self.held = 0  # shard version of the θ this replica holds
        self.current: Any = None  # the Assignment being computed
        self.next_request: Any = None  # ref of the request for the next portion, sent with the last push
        self.upto: tuple[int, int] = (0, 0)  # (epoch, step) of the current segment's last round
        self.waited = 0.0  # seconds the current portion waited: for its assignment, and for θ of its round
        self.received = 0  # bytes of θ pulled for the current portion
        self.in_flight: list[tuple[list[Any], int]] = []  # this segment's pushes (refs, portions), in row order
        self.ahead: tuple[int, list[Any]] | None = None  # (round, refs of its θ asked for with a push)

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        portions = config.options_of("bsp").portions
        assert portions is not None
        return ConsistencyRule.backup_tasks(portions)

    @property
    def slices_per_step(self) -> int:
        assert self.options.portions is not None
        return self.options.portions

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
        self.in_flight = []
        while True:
            if self.next_request is None:
                self.next_request = self._request(None)
            t0 = time.perf_counter()
            assignment = ray.get(self.next_request)  # blocks while the round has nothing left for us
            self.next_request = None
            if assignment is None:
                return
            self.waited, self.received = time.perf_counter() - t0, 0
            if assignment.tag > self.held:
                self.received = self.trainer.nbytes
                params = self.trainer.params_flat.numpy()
                if self.ahead is not None and self.ahead[0] == assignment.tag:  # asked for with the last push
                    t1 = time.perf_counter()
                    _, versions = self.channel.ps.install_pulled(self.ahead[1], params)
                    self.waited += time.perf_counter() - t1  # this worker's wait (the shards' began earlier)
                else:
                    waited, versions = self.channel.ps.pull_at(assignment.tag, params)
                    self.waited += waited
                self.ahead = None
                self.held = min(versions)
                if max(versions) > assignment.tag:
                    # The round closed while we were told to help (some shard already applied it):
                    # this θ may mix two versions, so computing on it is pointless at best.
                    continue
            self.current = assignment
            yield assignment.epoch, assignment.step, assignment.portion

    def unit_slices(self, slice_: int) -> range:
        """The chunk being computed: its portions, from `slice_`."""
        return range(slice_, slice_ + self.current.count)

    def _request(self, finished: tuple[int, int, list[Any]] | None) -> Any:
        return self.scheduler.acquire.remote(self.ctx.rank, finished, *self.upto)

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        a = self.current
        t0 = time.perf_counter()
        # A non-finite portion gradient is never pushed; skipped, the portion counts as done with nothing.
        ok = self.usable_gradient(trainer, "loss or gradient", check_loss=True)
        if ok:  # --clip-grad-norm: each push's own gradient, as under the other PS strategies
            trainer.clip_gradient_()
        grads = trainer.grads_flat.numpy() if ok else None
        pushes = self.channel.push_portion_async(a.tag, a.portion, grads, lr, a.count)
        self.next_request = self._request((a.tag, a.portion, pushes))
        self.in_flight.append((pushes, a.count))
        if (self.ahead is None or self.ahead[0] <= a.tag) and (a.epoch, a.step) != self.upto:
            # The next round's θ, answered once the shards apply this one (not past the segment's last
            # round: a call never answered would outlive the run on a warm shard).
            self.ahead = (a.tag + 1, self.channel.ps.pull_at_async(a.tag + 1))
        return CommStats(
            seconds=time.perf_counter() - t0 + self.waited,
            bytes_sent=trainer.nbytes,
            bytes_received=self.received,
            wait_s=self.waited,
            read_version=a.tag,
            applied_version=a.tag,  # settled: None where the shards kept another copy
            lag=0,
            backup=a.copy,
            nonfinite=None if ok else True,
        )

    def settle(self, rows: dict[str, list[Any]]) -> None:
        """Wait for this segment's pushes, mark the copies the shards dropped, and cut each chunk's row
        into one per portion."""
        verdicts = ray.get([refs[0] for refs, _ in self.in_flight])  # copies are identical: shard 0 speaks
        ray.get([ref for refs, _ in self.in_flight for ref in refs[1:]])
        for i, counted in enumerate(verdicts):
            rows["dropped"][i] = not counted
            if not counted:
                rows["applied_version"][i] = None
        per_portion(rows, [count for _, count in self.in_flight])
        self.in_flight = []


SHARED = frozenset({"compute_s", "comm_s", "h2d_s", "wait_s", "samples"})  # split equally over a chunk's portions
ONCE = frozenset({"bytes_sent", "bytes_received", "bytes_uncompressed"})  # on a chunk's first portion
NOT_ROWS = frozenset({"broken", "diverged", "channel_state", "nonfinite_shards"})  # a segment's notes to the driver


def per_portion(rows: dict[str, list[Any]], counts: list[int]) -> None:
    """Cut row i (a chunk of `counts[i]` portions; rows past `counts` are single) into one row per portion,
    in place: `slice` counts up from the chunk's first portion, SHARED columns are split equally, ONCE
    columns go on the first portion's row (0 on the others), the rest are repeated."""
    n = len(rows["step"])
    counts = counts[:n] + [1] * (n - len(counts))
    if all(c == 1 for c in counts):
        return
    for key, column in rows.items():
        if key in NOT_ROWS or not isinstance(column, list) or len(column) != n:
            continue  # not a per-row column
        out: list[Any] = []
        for value, c in zip(column, counts, strict=True):
            if c == 1:
                out.append(value)
            elif key == "slice":
                out.extend(value + j for j in range(c))
            elif key in SHARED and value is not None:
                out.extend([value // c if isinstance(value, int) else value / c] * c)
            elif key in ONCE and value is not None:
                out.extend([value] + [0] * (c - 1))
            else:
                out.extend([value] * c)
        rows[key] = out
