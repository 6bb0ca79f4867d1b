"""The planner's micro-benchmark actor: an all-reduce in a two-rank gloo group, and an echo call.

An actor of its own (not a worker) so the figures are the transport's, without a model or a strategy."""

from __future__ import annotations

import statistics
import time

import numpy as np
import ray


@ray.remote(num_cpus=0)
class Probe:
    def address(self) -> str:
        from distrain.strategies.collective import host_rendezvous

        return host_rendezvous("127.0.0.1", 60.0)

    def join(self, rank: int, world: int, address: str) -> None:
        from distrain.strategies.collective import CollectiveGroup

        self.group = CollectiveGroup(rank, world, address, "gloo", 60.0)

    def all_reduce(self, numel: int, reps: int) -> float:
        """Median seconds of an all-reduce of `numel` float32s (after one untimed)."""
        import torch

        t = torch.zeros(max(1, numel))
        self.group.all_reduce_mean_(t)
        return statistics.median(self.group.all_reduce_mean_(t) for _ in range(reps))

    def echo_time(self, nbytes: int, reps: int) -> float:
        """Median seconds of a call to another actor carrying `nbytes` there and back."""
        peer = Echo.remote()
        try:
            payload = np.zeros(max(0, nbytes), dtype=np.uint8)
            ray.get(peer.echo.remote(payload))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                ray.get(peer.echo.remote(payload))
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            ray.kill(peer, no_restart=True)


@ray.remote(num_cpus=0)
class Echo:
    def echo(self, a: np.ndarray) -> np.ndarray:
        return a
