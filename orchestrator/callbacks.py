"""Callbacks: a user's hooks into a run (`distrain.Callback`), and the driver's list of them.

    class Stop(distrain.Callback):
        def on_epoch_end(self, epoch, metrics):
            return metrics["val_loss"] < 0.01       # True: stop after the segments under way (early stopping)

    distrain.fit(task=..., callbacks=[Stop()])    # or run_training(config, callbacks=[...])

Every hook runs in the driver process, in order, between the driver's own steps (never concurrently
with another hook). A hook that returns True, or a callback whose `should_stop` attribute is true after
any hook, asks the run to stop: no new segments are handed out, the workers finish the steps already
given to them (so every worker stops at the same step, as a run with a smaller --max-steps would),
the last partial epoch is evaluated, and the run ends with status "stopped", its final checkpoint,
metrics and summary written. A hook that raises is the callback's own bug: the run ends "failed"
(what it recorded is kept) and the exception propagates with its traceback, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.config import RunConfig, Target


@dataclass
class RunInfo:
    """What `on_run_start` receives: the run as it starts (a resumed run's start_step is not 0)."""

    run_dir: Path
    config: RunConfig
    total_steps: int
    steps_per_epoch: int
    start_step: int
    num_params: int
    target: Target | None  # the run's quality target (--target, or the task's default)


class Callback:
    """Subclass and override any of the hooks; each may return True to ask the run to stop."""

    should_stop: bool = False  # set it (in a hook, or from another thread) to ask the run to stop

    def on_run_start(self, info: RunInfo) -> bool | None:
        """Once, when the workers are ready and before the first step (not again after a recovery)."""
        return None

    def on_rows(self, rows: dict[str, list[Any]]) -> bool | None:
        """Each segment's metrics rows as they arrive, as columns (worker, step, epoch, loss, lr, samples,
        wall_time, compute_s, comm_s, ...; one row per worker step, `step` the global step), and a
        `train_<name>` column per scalar the task logs from its `loss` (null on rows that logged none)."""
        return None

    def on_epoch_end(self, epoch: int, metrics: dict[str, float]) -> bool | None:
        """After each evaluation (every --eval-every epochs and the last; a stopped run's last partial
        epoch too): `epoch` is 0-based; `metrics` has every validation metric by its column name (val_loss,
        val_accuracy, val_<name>), the test set's (test_<name>) where this evaluation scored it (the
        run's last, or every one with --test-every-epoch), plus train_loss (the last step's), steps_done
        and elapsed_s."""
        return None

    def on_checkpoint(self, path: Path, step: int) -> bool | None:
        """After a checkpoint file is written (periodic, between --schedule phases, and the final one)."""
        return None

    def on_run_end(self, summary: dict[str, Any]) -> None:
        """Once, with the summary.json just written, whatever the status (completed, stopped, failed,
        interrupted); the place to close files."""
        return None


class Callbacks:
    """The driver's callbacks: calls a hook on each and remembers whether one asked to stop."""

    def __init__(self, callbacks: list[Callback] | tuple[Callback, ...] | None = None) -> None:
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                from distrain.errors import ConfigError

                raise ConfigError(f"callbacks must be distrain.Callback instances, got {type(cb).__name__}")
        self.stop_requested = False
        self.ended = False

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            try:
                answer = getattr(cb, hook)(*args)
            except Exception as e:
                e.add_note(f"(raised by the callback {type(cb).__name__}.{hook}; the run ends failed)")
                raise
            if answer is True or getattr(cb, "should_stop", False):
                self.stop_requested = True

    def poll(self) -> bool:
        """Whether a callback asked to stop (its `should_stop` may be set from another thread)."""
        if not self.stop_requested and any(getattr(cb, "should_stop", False) for cb in self.callbacks):
            self.stop_requested = True
        return self.stop_requested

    def end(self, summary: dict[str, Any], quiet: bool = False) -> None:
        """on_run_end, once. `quiet`: the run is failing already; a callback's error here would hide the
        first one, so it is dropped."""
        if self.ended:
            return
        self.ended = True
        for cb in self.callbacks:
            try:
                cb.on_run_end(summary)
            except Exception as e:
                if quiet:
                    continue
                e.add_note(f"(raised by the callback {type(cb).__name__}.on_run_end)")
                raise
