"""The worker side of the parameter-server transport: push a gradient, pull θ, over K shards at once.

Each call fans out to every shard concurrently (one Ray call per shard, all in flight before the
first `ray.get`). Gradient slices travel as numpy arrays through Ray's object store; the returned θ
slices are read zero-copy and copied once, straight into the replica's flat parameter buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from distrain.strategies.network import Link
from distrain.strategies.ps_shard import Reply
from distrain.trainers.optim_state import FlatOptimizerState


@dataclass
class PushPullResult:
    seconds: float
    wait_s: float  # the longest block any shard imposed
    read_version: int  # shard 0's version the gradient was computed on
    applied_version: int  # shard 0's version when it was applied
    lag: int  # the largest t_apply - t_read over the shards
    clock: int
    min_clock: int  # the slowest worker's clock, as the least up-to-date shard saw it
    version: int  # the least version any shard returned: the round this worker computes next
    dropped: bool  # some shard dropped the gradient as late (k-of-n)


class PSClient:
    def __init__(
        self,
        shards: list[Any],
        bounds: list[tuple[int, int]],
        worker: int,
        timeout_s: float | None = None,
        link: Link | None = None,
    ) -> None:
        self.link = link or Link()  # the emulated network: a push-pull is one transfer (network.py)
        self.shards = shards
        self.timeout_s = timeout_s  # a shard silent this long counts as hung (GetTimeoutError)
        self.bounds = bounds
        self.worker = worker
        self.read_versions = [0] * len(shards)

    def _install(self, replies: list[Reply], params: np.ndarray) -> None:
        for (start, stop), reply in zip(self.bounds, replies, strict=True):
            params[start:stop] = reply.theta
        self.read_versions = [r.version for r in replies]

    def pull(self, params: np.ndarray) -> int:
        """Overwrite `params` with the shards' current θ (no consistency wait); returns this worker's clock."""
        replies: list[Reply] = ray.get([s.pull.remote(self.worker) for s in self.shards], timeout=self.timeout_s)
        self._install(replies, params)
        return replies[0].clock

    def push_pull(
        self, clock: int, grads: np.ndarray | list[Any] | None, lr: float, params: np.ndarray
    ) -> PushPullResult:
        """Push `grads` (None: a skipped step, the clock only; a list: each shard's slice already encoded,
        (codec, Encoded) pairs, under --compress), then install θ."""
        t0 = time.perf_counter()
        if isinstance(grads, list):
            pushes, pushed = grads, sum(encoded.nbytes for _, encoded in grads)
        else:
            pushes = [None if grads is None else grads[start:stop] for start, stop in self.bounds]
            pushed = 0 if grads is None else grads.nbytes
        if self.link.emulated:  # the push (None: a clock-only message) and the pull of θ, 4 bytes a value
            done = self.link.reserve(pushed + params.nbytes, t0)
        read = self.read_versions
        refs = [
            shard.push_pull.remote(self.worker, clock, push, lr, read[i])
            for i, (shard, push) in enumerate(zip(self.shards, pushes, strict=True))
        ]
        replies: list[Reply] = ray.get(refs, timeout=self.timeout_s)
        self._install(replies, params)
        if self.link.emulated:
            self.link.hold_until(done)
        return PushPullResult(
            seconds=time.perf_counter() - t0,
            wait_s=max(r.wait_s for r in replies),
            read_version=read[0],
            applied_version=replies[0].applied_version,
            lag=max(r.lag for r in replies),
            clock=replies[0].clock,
            min_clock=min(r.min_clock for r in replies),
            version=min(r.version for r in replies),
            dropped=any(r.dropped for r in replies),
        )

    def push_portion_async(
        self, tag: int, portion: int, grads: np.ndarray | None, lr: float, count: int = 1
    ) -> list[Any]:
        """Backup tasks: offer one chunk's gradient (`count` portions from `portion`) to every shard; refs to
        each shard's verdict (True: the copy that counts). `grads` may be reused at once: the slices are
        serialised here."""
        return [
            shard.push_portion.remote(
                self.worker, tag, portion, None if grads is None else grads[start:stop], lr, count
            )
            for shard, (start, stop) in zip(self.shards, self.bounds, strict=True)
        ]

    def pull_at(self, version: int, params: np.ndarray) -> tuple[float, list[int]]:
        """Wait until every shard has applied `version` updates, then install θ.

        Returns the seconds waited and each shard's version (a shard may already be further on).
        """
        return self.install_pulled(self.pull_at_async(version), params)

    def pull_at_async(self, version: int) -> list[Any]:
        """`pull_at`'s calls, sent now (each shard answers once it has applied `version` updates)."""
        return [s.pull_at.remote(self.worker, version) for s in self.shards]

    def install_pulled(self, refs: list[Any], params: np.ndarray) -> tuple[float, list[int]]:
        """Install θ from `pull_at_async`'s replies (waiting for them): as `pull_at` returns."""
        replies: list[Reply] = ray.get(refs)
        self._install(replies, params)
        return max(r.wait_s for r in replies), [r.version for r in replies]

    def snapshot(self) -> tuple[np.ndarray, FlatOptimizerState, dict[str, Any]]:
        """θ and the optimizer state of the whole vector, from every shard's snapshot, and the counters
        (version, worker clocks, and a task's own scheduler's state where the shards step one) a restored
        shard continues from. Every push reaches every shard, and every shard applies the same updates,
        so shard 0's counters are everyone's."""
        snaps = ray.get([s.snapshot.remote() for s in self.shards], timeout=self.timeout_s)
        theta = np.concatenate([snap["theta"] for snap in snaps])
        optimizer = FlatOptimizerState.concat([FlatOptimizerState.from_dict(snap["optimizer"]) for snap in snaps])
        return theta, optimizer, counters_of(snaps[0])


def counters_of(snapshot: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's "ps" entry keeps of a shard's snapshot: its version, the worker clocks and,
    where the shards step a task's own scheduler, its state (strategies/ps_shard.py)."""
    counters = {"version": snapshot["version"], "clocks": list(snapshot["clocks"])}
    if "scheduler" in snapshot:
        counters["scheduler"] = snapshot["scheduler"]
    return counters
