"""What the controller starts from (`Plan`, made by run.py's preflight) and what outlives an attempt
(`RunState`), and `Diverged`, the end of a run that went non-finite."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.config import RunConfig
from distrain.orchestrator import memory
from distrain.orchestrator.chaos import ChaosMonkey
from distrain.orchestrator.files import Claim
from distrain.orchestrator.membership import Membership
from distrain.orchestrator.metrics import MetricsSink
from distrain.orchestrator.recovery import FailureLedger, RestorePoint


@dataclass
class Plan:
    """What preflight found: where to write, and what to start from."""

    run_dir: Path
    num_params: int
    checkpoint: dict[str, Any] | None
    resumed: bool = False  # --resume: the run directory is an existing run, continued from its checkpoint
    checkpoint_path: Path | None = None
    claim: Claim | None = None  # a new run's directory, given back if the run is refused before it starts
    rows: dict[str, list[Any]] | None = None  # --resume: the metrics rows before the checkpoint's step
    memory: memory.MemoryEstimate | None = None
    # --strategy auto: what the planner chose and why (planning/auto_strategy.py; recorded by auto_choice.py)
    auto: dict[str, Any] | None = None


@dataclass
class RunState:
    """What outlives one attempt of a run (a failure ends an attempt; the run goes on in a new one)."""

    sink: MetricsSink
    ledger: FailureLedger
    chaos: ChaosMonkey
    point: RestorePoint  # where the next attempt starts from
    run_start: float
    steps_per_epoch: int = 0
    steps_done: int = 0  # global steps complete (as the current attempt's driver counts them)
    membership: Membership | None = None  # --workers MIN..MAX: its books go on across attempts

    @classmethod
    def create(cls, config: RunConfig, plan: Plan) -> RunState:
        sink = MetricsSink(plan.run_dir.name)
        for strategy in config.strategy_classes:  # their own step columns (a resumed run's rows have them)
            sink.declare(strategy.implementation(config).metric_columns)  # e.g. a pipeline's, under bsp
        ledger = FailureLedger(config.max_failures)
        ckpt = plan.checkpoint
        start = int(ckpt["global_step"]) if ckpt else 0
        run_start = time.time()
        if plan.resumed and ckpt is not None:
            sink.add_rows(plan.rows or {})
            ledger.events = list(ckpt.get("failures") or [])
            run_start -= float(ckpt.get("elapsed_s", 0.0))  # run time goes on from where it stopped
        point = RestorePoint(ckpt, start, time.time() - run_start, plan.checkpoint_path)
        return cls(sink, ledger, ChaosMonkey(config.chaos_events), point, run_start)


class Diverged(Exception):
    """--on-nonfinite stop: a worker's loss, gradient or average, or the parameters to checkpoint, are
    not finite. The run ends with status "diverged"; nothing after the last good checkpoint is saved."""

    def __init__(self, step: int, worker: int | None, what: str) -> None:
        super().__init__(step, worker, what)
        self.step, self.worker, self.what = step, worker, what

    def describe(self) -> dict[str, Any]:
        """summary.json's `diverged` record (the other reasons: orchestrator/outcome.py's `judge`)."""
        return {"reason": "nonfinite", "step": self.step, "worker": self.worker, "what": self.what}


def recorded(config: RunConfig, run_dir: Path) -> RunConfig:
    """The config as the run directory records it (its own directory as run_dir)."""
    return config.replace(run_dir=str(run_dir))
