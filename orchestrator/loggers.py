"""`--loggers`: callbacks that hand a run's figures to a logging back end, one value per name per step.

Every logger sees the same figures, x axis = global steps completed:
    train/loss            mean over the step's worker rows (every worker's slice of the global batch)
    train/lr              the step's learning rate
    train/<name>          mean of a scalar the task logs from its `loss` (`(loss, {"name": value})`)
    train/samples_per_s   the steady-state figure over the rows so far (orchestrator/throughput.py)
    val/<name>            each evaluation's validation metrics (loss, accuracy, the task's own)
    test/<name>           the test set's, where an evaluation scored it (the run's last)

`Logger` turns the driver's hooks (worker rows, evaluations) into those figures; a back end implements
`open`, `write`, `flush` and `close`: tensorboard (orchestrator/tensorboard.py), csv (csv_logger.py),
mlflow (mlflow_logger.py); `logger_choice.build_loggers` makes those a run names. A step is written once
every worker's row of it is in (rows arrive per segment and per worker, in any order, an evaluation's
sometimes before them), and at the run's end whatever is still pending.
"""

from __future__ import annotations

import math
from typing import Any

from distrain.orchestrator.callbacks import Callback, RunInfo
from distrain.orchestrator.metrics import LOGGED_PREFIX
from distrain.orchestrator.throughput import SteadyState


class _Step:
    """One global step's rows so far: how many, its lr, and sum/count of each averaged figure."""

    __slots__ = ("rows", "lr", "sums")

    def __init__(self, lr: float) -> None:
        self.rows = 0
        self.lr = lr
        self.sums: dict[str, list[float]] = {}

    def add(self, name: str, value: Any) -> None:
        if value is not None and math.isfinite(value):
            acc = self.sums.setdefault(name, [0.0, 0])
            acc[0] += float(value)
            acc[1] += 1


class Logger(Callback):
    """A back end of `--loggers`: override `open`, `write` and `close` (and `flush`)."""

    def __init__(self) -> None:
        self.opened = False
        self.workers = 1
        self.meter = SteadyState()
        self.pending: dict[int, _Step] = {}

    # ------------------------------------------------------------------ the back end's part
    def open(self, info: RunInfo) -> None:
        """The run starts (`info.run_dir`, `info.config`): open the files or the remote run."""

    def write(self, step: int, values: dict[str, float]) -> None:
        """Figures of `step` (global steps completed), by name ("train/loss", "val/accuracy", "test/accuracy", ...)."""
        raise NotImplementedError

    def flush(self) -> None:
        """After each evaluation: what was written so far reaches its file or server."""

    def close(self, summary: dict[str, Any]) -> None:
        """The run ended (`summary["status"]`); everything is written."""

    # ------------------------------------------------------------------ the driver's hooks
    def on_run_start(self, info: RunInfo) -> None:
        self.workers = info.config.num_worker_actors  # rows per global step: one per worker slice
        self.open(info)
        self.opened = True

    def on_rows(self, rows: dict[str, list[Any]]) -> None:
        if not self.opened:
            return
        self.meter.add_steps(rows["step"], rows["samples"], rows["wall_time"], rows.get("dropped"))
        logged = [name for name in rows if name.startswith(LOGGED_PREFIX)]
        full = []
        for i, (step, loss, lr) in enumerate(zip(rows["step"], rows["loss"], rows["lr"], strict=True)):
            entry = self.pending.get(int(step))
            if entry is None:
                entry = self.pending[int(step)] = _Step(float(lr))
            entry.add("train/loss", loss)
            for name in logged:
                entry.add(f"train/{name.removeprefix(LOGGED_PREFIX)}", rows[name][i])
            entry.rows += 1
            if entry.rows >= self.workers:
                full.append(int(step))
        self._write_steps(sorted(set(full)))

    def on_epoch_end(self, epoch: int, metrics: dict[str, float]) -> None:
        if not self.opened:
            return
        # Steps still waiting for a worker's rows stay pending: an evaluation can begin before the driver has
        # taken in every worker's last segment (their rows come after it), and a step half averaged would
        # be written wrong. A step some worker never reports (k-of-n, backup tasks) is written at the end.
        done = int(metrics["steps_done"])
        # val/loss, val/accuracy each evaluation; test/... where it scored the test set (the run's last)
        evaluated = {
            "/".join(name.split("_", 1)): float(value)
            for name, value in metrics.items()
            if name.startswith(("val_", "test_")) and value is not None
        }
        if evaluated:
            self.write(done, evaluated)
        self.flush()

    def on_run_end(self, summary: dict[str, Any]) -> None:
        if not self.opened:
            return
        self._write_steps(sorted(self.pending))
        self.opened = False
        self.close(summary)

    def _write_steps(self, steps: list[int]) -> None:
        if not steps:
            return
        speed = self.meter.samples_per_s()
        for step in steps:
            entry = self.pending.pop(step)
            values = {name: total / count for name, (total, count) in entry.sums.items()}
            values["train/lr"] = entry.lr
            if speed is not None and step == steps[-1]:
                values["train/samples_per_s"] = speed
            self.write(step + 1, values)
