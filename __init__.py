"""distrain: distributed SGD strategies on Ray, one flag apart.

The public API (imported lazily, so `distrain --help` starts without loading torch or Ray):

- `distrain.fit(task=..., **options)` -> `distrain.FitResult`: train, the way `distrain run` does.
- `distrain.Task`: subclass it to train your own model, data, loss and metrics.
- `distrain.ClassificationTask`: the built-in task (a registered model on a registered data set).
- `distrain.Callback`: hooks into a run (start, rows, evaluations, checkpoints, end) that may stop it.
- `distrain.ConfigError`: raised by your task for bad settings, it is shown as one line (exit 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Callback", "ClassificationTask", "ConfigError", "FitResult", "Task", "fit", "__version__"]

if TYPE_CHECKING:
    from distrain.api import FitResult, fit
    from distrain.errors import ConfigError
    from distrain.orchestrator.callbacks import Callback
    from distrain.trainers.task import ClassificationTask, Task

_LAZY = {
    "fit": "distrain.api",
    "FitResult": "distrain.api",
    "Callback": "distrain.orchestrator.callbacks",
    "Task": "distrain.trainers.task",
    "ClassificationTask": "distrain.trainers.task",
    "ConfigError": "distrain.errors",  # raise it from a task's constructor for a one-line error
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distrain' has no attribute {name!r}")
