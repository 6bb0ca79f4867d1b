"""--checkpoint-best METRIC: keep the checkpoint of the best evaluation as checkpoints/best.pt (Lightning's
`ModelCheckpoint(monitor=...)`), and say which one it is (summary.json's `best_checkpoint`,
`FitResult.best_checkpoint`).

A checkpoint is written at every evaluated epoch of such a run (`checkpoint_period`), and a checkpoint
is written only once the evaluations of the epochs before it are in (Attempt.save_complete): so when a
checkpoint of the step an evaluation scored is written, that evaluation is known to be the best so far
or not, and best.pt becomes a copy of it (a sharded run's file names its shards folder beside it, which
is kept). A copy, not a pointer: a user may move or prune the epoch checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from distrain.config import Monitor, RunConfig, parse_monitor
from distrain.orchestrator.files import atomic_write

BEST = "best.pt"


def checkpoint_period(config: RunConfig) -> int:
    """--checkpoint-every as the run uses it: with --checkpoint-best and no period of its own, every
    evaluated epoch (--eval-every, or 1 with evaluations only at the end: the last epoch is checkpointed
    by the run's end anyway)."""
    if config.checkpoint_every or not config.checkpoint_best:
        return config.checkpoint_every
    return config.eval_every or 1


class BestKeeper:
    """The best evaluation so far by the run's monitor, and the copy of its checkpoint."""

    def __init__(self, config: RunConfig, run_dir: Path, rows: dict[str, list[Any]] | None = None) -> None:
        self.monitor: Monitor | None = parse_monitor(config.checkpoint_best) if config.checkpoint_best else None
        self.directory = run_dir / "checkpoints"
        self.value: float | None = None
        self.step: int | None = None  # the step the best evaluation scored
        self.epoch: int | None = None
        self.saved_step: int | None = None  # the step of the checkpoint best.pt holds
        if self.monitor is not None and rows:
            # A recovered or resumed run: the evaluations recorded before its checkpoint (those the run keeps)
            # hold the one to beat, whose copy an earlier attempt made.
            for kind, epoch, step, value in zip(
                rows["kind"], rows["epoch"], rows["step"], rows.get(self.monitor.metric, []), strict=False
            ):
                if kind == "eval":
                    self.seen(epoch, step, {self.monitor.metric: value})
            if self.step is not None and (self.directory / BEST).is_file():
                self.saved_step = self.step

    def seen(self, epoch: int, step: int, figures: dict[str, float]) -> None:
        """An evaluation of the model after `step` steps (its figures by column)."""
        if self.monitor is None:
            return
        value = figures.get(self.monitor.metric)
        if self.monitor.better(value, self.value):
            self.value, self.step, self.epoch = value, step, epoch

    def saved(self, path: Path, step: int, steps_per_epoch: int) -> None:
        """A checkpoint of the state after `step` steps was written at `path`: best.pt becomes a copy of
        it if it is the best evaluation's."""
        if self.monitor is None or self.step is None or self.saved_step == self.step or path.name == BEST:
            return
        # A shared plan's evaluation scores the steps done when it ran, its epoch checkpoint the epoch's end.
        epoch_end = (self.epoch + 1) * steps_per_epoch if self.epoch is not None else None
        if step not in (self.step, epoch_end):
            return
        atomic_write(self.directory / BEST, lambda tmp: shutil.copyfile(path, tmp))
        self.saved_step = self.step

    def summary(self) -> dict[str, Any] | None:
        """summary.json's `best_checkpoint`: its path (relative to the run directory), the metric, its
        value and the epoch and step evaluated; None with --checkpoint-best and no checkpoint kept yet."""
        if self.monitor is None or self.saved_step is None:
            return None
        return {
            "path": f"checkpoints/{BEST}",
            "metric": self.monitor.metric,
            "mode": self.monitor.mode,
            "value": self.value,
            "epoch": self.epoch,
            "step": self.step,
        }


def best_of(run_dir: Path) -> dict[str, Any] | None:
    """The `best_checkpoint` summary.json records, with the path made absolute; None without one."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    best = summary.get("best_checkpoint")
    if not isinstance(best, dict) or not (run_dir / best["path"]).is_file():
        return None
    return best | {"path": str(run_dir / best["path"])}
