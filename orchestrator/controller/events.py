"""What a run tells its caller: the display's events and the result (re-exported by orchestrator/run.py,
where the CLI and the API import them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distrain.orchestrator.membership import MembershipChanged
from distrain.orchestrator.recovery import Failure


@dataclass
class RunStarted:
    run_dir: Path
    total_steps: int
    steps_per_epoch: int
    num_params: int
    nodes: int
    start_step: int = 0  # global steps already done (a resumed run, or one started --init-from)
    elapsed_s: float = 0.0  # run time so far, as Progress counts it (a resumed run's goes on)


@dataclass
class Progress:
    epoch: int
    epochs: int
    steps_done: int
    total_steps: int
    loss: float
    samples_per_s: float | None  # steady-state figure over the rows so far (orchestrator/throughput.py)
    val_accuracy: float | None  # the last evaluation's, on the validation split
    evaluated: bool = False  # True on the event that carries a fresh evaluation
    val_loss: float | None = None  # set on evaluated events
    elapsed_s: float = 0.0  # run time so far (a resumed run's goes on from where it stopped)
    # the last evaluation's figures by column (val_loss, val_accuracy, and test_* where the test set was scored)
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class Preparing:
    """Start-up progress before the workers start: what the driver does now (the run's checks, starting
    or joining Ray, placing the workers), with the run's directory once it is claimed."""

    stage: str
    run_dir: Path | None = None


@dataclass
class WorkersStarting:
    """Start-up progress: `started` of `total` worker actors are up (each imports torch and loads its
    data, which takes a while with many workers on few cores)."""

    started: int
    total: int


@dataclass
class Notice:
    """One line the user should read before the run starts (e.g. GPUs present but not asked for)."""

    text: str


@dataclass
class StragglersChanged:
    """The straggler detector's verdict changed: `slow` maps each flagged worker to its pace ratio."""

    step: int
    slow: dict[int, float]


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    worker_info: list[dict[str, Any]] = field(default_factory=list)
    shard_nodes: list[str] = field(default_factory=list)  # node id of each PS shard (PS runs)


Event = RunStarted | Progress | StragglersChanged | Failure | Preparing | WorkersStarting | Notice | MembershipChanged
EventHandler = Callable[[Event], None]
