"""distrain: distributed SGD strategies on Ray, one flag apart.

The public API (imported lazily, so `distrain --help` starts without loading torch or Ray):

- `distrain.fit(task=..., **options)` -> `distrain.FitResult`: train, the way `distrain run` does.
- `distrain.load_model(run_dir_or_checkpoint)`, `FitResult.model()`: the task's model with a run's weights.
- `distrain.Task`: subclass it to train your own model, data, loss and metrics.
- `distrain.ClassificationTask`: the built-in task (a registered model on a registered data set).
- `distrain.Callback`: hooks into a run (start, rows, evaluations, checkpoints, end) that may stop it.
- `distrain.ConfigError`: raised by your task for bad settings, it is shown as one line (exit 2).
- `distrain.RunFailed`: what `fit` raises when a run fails after it started (its --max-failures used up,
  a full disk); a diverged run is no exception: its result's `status` is "diverged".
- `distrain.Strategy`, `distrain.StrategyOptions`, `distrain.CommStats`, `distrain.setting`: write your own
  strategy in one file (see examples/strategies/easgd.py) and pass it as `strategy="file.py:Name"`.
- `distrain.DriverActor`, `distrain.ActorSetup`: an actor of the strategy's own that the driver starts beside
  the workers (`Strategy.driver_actors`); each worker reaches it as `self.ctx.driver_actors[name]`.
- `distrain.Channel`, `distrain.Traffic`: what a strategy sends through (`self.channel`: all-reduce,
  broadcast, all-gather, reduce-scatter, push/pull, by named stream) and what a transfer cost; the run's
  --compress, emulated link and byte counts apply to every stream.
- `distrain.RunConfig`: the run's spec, one frozen section per concern plus each strategy's options.

These names are the public surface (docs/architecture.md, "The public surface"); every other module of the
package is internal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "ActorSetup",
    "Callback",
    "ClassificationTask",
    "Channel",
    "CommStats",
    "ConfigError",
    "DriverActor",
    "FitResult",
    "RunConfig",
    "RunFailed",
    "Strategy",
    "StrategyOptions",
    "Task",
    "Traffic",
    "fit",
    "load_model",
    "setting",
    "__version__",
]

if TYPE_CHECKING:
    from distrain.api import FitResult, fit
    from distrain.config import RunConfig
    from distrain.errors import ConfigError, RunFailed
    from distrain.fields import setting
    from distrain.orchestrator.callbacks import Callback
    from distrain.orchestrator.trained_model import load_model
    from distrain.strategies.base import CommStats, Strategy, StrategyOptions
    from distrain.strategies.channel import Channel, Traffic
    from distrain.strategies.driver_actor import ActorSetup, DriverActor
    from distrain.trainers.task import ClassificationTask, Task

_LAZY = {
    "fit": "distrain.api",
    "load_model": "distrain.orchestrator.trained_model",  # a run's model back, with its weights
    "FitResult": "distrain.api",
    "Callback": "distrain.orchestrator.callbacks",
    "Task": "distrain.trainers.task",
    "ClassificationTask": "distrain.trainers.task",
    "ConfigError": "distrain.errors",  # raise it from a task's constructor for a one-line error
    "RunConfig": "distrain.config",
    "RunFailed": "distrain.errors",  # fit's error for a run that failed after it started
    "Strategy": "distrain.strategies.base",
    "StrategyOptions": "distrain.strategies.base",
    "CommStats": "distrain.strategies.base",
    "setting": "distrain.fields",
    "Channel": "distrain.strategies.channel",  # a strategy's transfers (Strategy.channel)
    "Traffic": "distrain.strategies.channel",
    "DriverActor": "distrain.strategies.driver_actor",  # a strategy's own driver-side actor (driver_actors)
    "ActorSetup": "distrain.strategies.driver_actor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distrain' has no attribute {name!r}")
