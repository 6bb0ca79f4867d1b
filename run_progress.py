"""What `distrain run`'s display works out besides drawing (commands/run_display.RunDisplay): the run's clock (time
elapsed since the run's start, the same in the live bar and in piped lines, and the time left) and
the heartbeat that keeps piped output from going silent for long. Knows neither Ray, torch nor rich.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping

from distrain.errors import ConfigError

HEARTBEAT_ENV = "DISTRAIN_PROGRESS_EVERY_S"
DEFAULT_HEARTBEAT_S = 30.0  # a log or `ray job submit` shows a line at least this often


def heartbeat_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """The longest piped output may stay silent (DISTRAIN_PROGRESS_EVERY_S; 0: no such lines)."""
    raw = environ.get(HEARTBEAT_ENV, "").strip()
    if not raw:
        return DEFAULT_HEARTBEAT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{HEARTBEAT_ENV}={raw!r}: expected seconds, e.g. 30 (0 turns these lines off)")
    return value


def clock_text(seconds: float) -> str:
    """h:mm:ss."""
    whole = int(max(seconds, 0.0))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class RunClock:
    """Elapsed run time and time left, from the events' own figures (each carries the run's elapsed
    time, measured by the driver from the run's start; a resumed run's goes on) and, between events,
    `clock`.

    The rate behind the time left is the steps done since the first progress of this attempt over the
    run time they took: the start-up before that (Ray, the workers loading their data) is not a step's
    cost, while the evaluations are (they come back every epoch)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.first: tuple[float, int] | None = None  # (elapsed_s, steps) of the first progress
        self.last: tuple[float, int, int] | None = None  # (elapsed_s, steps, total) of the latest
        self.seen = 0.0  # clock() when the latest figures came
        self.elapsed_then = 0.0  # their elapsed_s

    def started(self, elapsed_s: float) -> None:
        """The run (or a new attempt of it) started: its elapsed time so far."""
        self.first = self.last = None
        self.seen, self.elapsed_then = self.clock(), elapsed_s

    def progress(self, elapsed_s: float, steps: int, total: int) -> None:
        if self.first is None or steps < self.first[1]:  # restarted from a checkpoint: a new rate
            self.first = (elapsed_s, steps)
        self.last = (elapsed_s, steps, total)
        self.seen, self.elapsed_then = self.clock(), elapsed_s

    def elapsed(self) -> float:
        return self.elapsed_then + self.clock() - self.seen

    def left_at(self, elapsed_s: float, steps: int, total: int) -> float | None:
        """Seconds left after `steps` of `total`, done at `elapsed_s`; None before a rate is known."""
        if self.first is None:
            return None
        e0, s0 = self.first
        if steps <= s0 or elapsed_s <= e0:
            return None
        return (total - steps) * (elapsed_s - e0) / (steps - s0)

    def left(self) -> float | None:
        """Seconds left now: as of the latest figures, less the time since."""
        if self.last is None:
            return None
        left = self.left_at(*self.last)
        return None if left is None else max(left - (self.clock() - self.seen), 0.0)


class Heartbeat:
    """Calls `beat` from a daemon thread every `period_s` until stopped (what it prints, and whether,
    is the caller's to decide: it sees the time since its own last line)."""

    def __init__(self, beat: Callable[[], None], period_s: float = 1.0) -> None:
        self.beat = beat
        self.period_s = period_s
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="distrain-progress", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * self.period_s)

    def _run(self) -> None:
        while not self.stopping.wait(self.period_s):
            self.beat()
