"""The emulated network of `--comm-delay-ms` and `--comm-bandwidth`, for studying communication-bound
training on one machine.

Each worker has one link. A transfer of `nbytes` launched at time t completes no earlier than
    max(t, the end of the link's previous transfer) + latency + nbytes / bandwidth,
so transfers queue on the link as on one network card, and a transfer launched while the worker
computes (a BSP bucket during backward) overlaps that compute: only the part still outstanding when
the worker needs the result is waited for. The real transfer runs as usual; the emulation only holds
the worker until the emulated completion time, so a transfer is never faster than the real one.
`nbytes` is what the worker puts on the wire for that transfer (a ring all-reduce: 2(P-1)/P of the
buffer; a PS push-pull: its push plus its pull, one request and its reply), the same count the
metrics' bytes_sent/bytes_received record. A single worker (P = 1) moves nothing and waits for nothing.
Not emulated: jitter, loss, congestion between workers, per-hop latency of the ring (one latency per
transfer, not 2(P-1)), and the portions of backup tasks (`--backup-tasks`), which go out as they
come in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distrain.config import RunConfig


@dataclass
class Link:
    latency_s: float = 0.0
    bytes_per_s: float | None = None  # None: unlimited
    busy_until: float = 0.0  # time.perf_counter() at which the last queued transfer completes

    @classmethod
    def of(cls, config: RunConfig) -> Link:
        from distrain.units import parse_rate

        bandwidth = parse_rate(config.comm_bandwidth) if config.comm_bandwidth else None
        return cls(config.comm_delay_ms / 1000, bandwidth)

    @property
    def emulated(self) -> bool:
        return self.latency_s > 0 or self.bytes_per_s is not None

    def transfer_s(self, nbytes: int) -> float:
        """The emulated duration of one transfer on an idle link."""
        return self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def reserve(self, nbytes: int, start: float | None = None) -> float:
        """Queue a transfer launched at `start` (default: now); returns when it completes (perf_counter)."""
        begin = max(time.perf_counter() if start is None else start, self.busy_until)
        self.busy_until = begin + self.transfer_s(nbytes)
        return self.busy_until

    @staticmethod
    def hold_until(deadline: float) -> None:
        """Block until the emulated completion time `deadline` (no-op if it has passed)."""
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
