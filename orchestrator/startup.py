"""Where a cold start goes: the driver's marks from process launch to the end of the first step.

`distrain run` prints one line at its end (commands/run.py), in the order the run passes them:

    start-up 8.4 s to the end of step 0: imports 2.1 s, checks 0.3 s, Ray start 2.8 s (ray.init 3.0 s,
    begun in the background), actors 2.5 s (data 0.2 s of it), first step 0.5 s

Each phase runs from the mark before it to its own, so they add up to the total (data is the slowest
worker's task, data and model build, a part of "actors"). Ray start is what the driver waited for: a
local Ray begun in the background (orchestrator/ray_start.py) ran alongside the imports, and its own
duration is given in brackets. Only the driver process's first run is clocked (a second `fit` in a
notebook is no cold start). No torch, no Ray: the CLI imports this module.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

# The driver's marks, in the order a run passes them: (name, what the phase ending there is called).
PHASES = (
    ("ready", "imports"),  # the run's code loaded and its config resolved (torch loaded by its checks)
    ("checked", "checks"),  # preflight: the task counted, the run directory claimed
    ("ray", "Ray start"),  # connected to a local Ray (started, or waited for)
    ("workers", "actors"),  # every worker described itself: its process, imports and replica built
)


@dataclass
class StartupClock:
    launched: float  # the process's start, seconds since the epoch
    marks: dict[str, float] = field(default_factory=dict)
    ray_init_s: float | None = None  # how long ray.init itself took, wherever it ran
    ray_in_background: bool = False
    data_s: float | None = None  # the slowest worker's build (task, data, model)
    first_step: int | None = None  # the first step's index and the end of its slowest rank (epoch seconds)
    first_step_end: float | None = None

    def mark(self, name: str, at: float | None = None) -> None:
        """The first time only: a later attempt of the same run is no start-up."""
        self.marks.setdefault(name, time.time() if at is None else at)

    def steps(self, steps: list[int], wall_times: list[float], run_start: float) -> None:
        """A batch of step rows (any rank's): the first step ends when its slowest rank's row says so."""
        if not steps:
            return
        first = min(steps)
        if self.first_step is not None and first > self.first_step:
            return
        end = max(run_start + w for s, w in zip(steps, wall_times, strict=True) if s == first)
        if self.first_step is None or first < self.first_step:
            self.first_step, self.first_step_end = first, end
        else:
            self.first_step_end = max(self.first_step_end or end, end)

    def phases(self) -> dict[str, float] | None:
        """Seconds per phase, in order, ending with "first step"; None while a mark is missing."""
        if self.first_step_end is None or any(name not in self.marks for name, _ in PHASES):
            return None
        out: dict[str, float] = {}
        before = self.launched
        for name, label in PHASES:
            out[label] = self.marks[name] - before
            before = self.marks[name]
        out["first step"] = self.first_step_end - before
        return out

    def line(self) -> str | None:
        phases = self.phases()
        if phases is None or self.first_step_end is None:
            return None
        parts = []
        for label, seconds in phases.items():
            text = f"{label} {seconds:.1f} s"
            if label == "Ray start" and self.ray_init_s is not None:
                where = ", begun in the background" if self.ray_in_background else ""
                text += f" (ray.init {self.ray_init_s:.1f} s{where})"
            if label == "actors" and self.data_s is not None:
                text += f" (data {self.data_s:.1f} s of it)"
            parts.append(text)
        total = self.first_step_end - self.launched
        return f"start-up {total:.1f} s to the end of step {self.first_step}: " + ", ".join(parts)


def process_launched() -> float:
    """This process's start (epoch seconds), from /proc where there is one; else now."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):  # not Linux
        return time.time()


# The driver process's clock, made by its first run (a later run in the process gets none).
_clock: StartupClock | None = None
_clocked = False  # a run has been clocked in this process: later ones are not cold starts


def begin() -> StartupClock | None:
    """The clock of this process's first run; None for any later run in the same process."""
    global _clock, _clocked
    if _clocked:
        return None
    _clocked = True
    _clock = StartupClock(process_launched())
    return _clock


def current() -> StartupClock | None:
    return _clock


def mark(name: str) -> None:
    if _clock is not None:
        _clock.mark(name)


def workers_up(info: list[dict[str, Any]]) -> None:
    """Every worker has described itself (`TrainWorker.describe`): its slowest build is the data phase."""
    if _clock is not None:
        _clock.mark("workers")
        builds = [i["build_s"] for i in info if i.get("build_s") is not None]
        if builds and _clock.data_s is None:
            _clock.data_s = max(builds)


def steps(steps: list[int], wall_times: list[float], run_start: float) -> None:
    if _clock is not None:
        _clock.steps(list(steps), list(wall_times), run_start)


def ray_started(seconds: float, in_background: bool) -> None:
    if _clock is not None and _clock.ray_init_s is None:
        _clock.ray_init_s, _clock.ray_in_background = seconds, in_background
