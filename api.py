"""The public Python API: `distrain.fit(...)` trains a task with a strategy and returns a `FitResult`.

    import distrain
    result = distrain.fit(task=MyTask(), strategy="local-sgd", adaptive_tau=True, workers=4)
    result.metrics["test_loss"], result.run_dir, result.summary

`fit` takes every option `distrain run` takes, by its config name (`--batch-size` is `batch_size`),
plus an optional YAML `config` file under them, and runs in a script or a notebook (also several
times in one process: each call starts and stops its own local Ray, or uses one already running).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.config import RunConfig, known_option_fields
from distrain.errors import ConfigError


@dataclass
class FitResult:
    """What a finished run left: its directory and its `summary.json` figures."""

    run_dir: Path
    summary: dict[str, Any]

    @property
    def metrics(self) -> dict[str, float | None]:
        """The last evaluation's figures by metric name (`test_loss`, `test_accuracy`, ...)."""
        return {k.removeprefix("final_"): v for k, v in self.summary.items() if k.startswith("final_test_")}

    @property
    def status(self) -> str:
        return str(self.summary.get("status"))


def fit(
    task: Any = None,
    *,
    config: str | Path | None = None,
    resume: str | Path | None = None,
    on_event: Callable[[Any], None] | None = None,
    callbacks: list[Any] | None = None,
    progress: bool = True,
    **options: Any,
) -> FitResult:
    """Train `task` (None: the built-in classification; an import path `module:Name` or
    `file.py:Name`; a `distrain.Task` subclass; or an instance) with the given options.

    `on_event` receives the run's events (RunStarted, Progress, Failure, ...); with `progress` (and no
    `on_event`) one line is printed per evaluation. `callbacks`: `distrain.Callback` objects whose hooks
    the run calls (and which may stop it: status "stopped"); `tensorboard="DIR"` adds the TensorBoard one.
    `resume`: continue the run in that directory from its latest checkpoint (`distrain run --resume`);
    `options` may then change only what a resume may change (e.g. `epochs`).
    A run that diverged (--on-nonfinite stop at a non-finite step; or at its end, more than
    `config.SKIPPED_SHARE_LIMIT` (10%) of its steps skipped as non-finite, or a final evaluation that is not
    finite) returns: its `status` is "diverged" and `summary["diverged"]` says why (`reason`). A run that
    failed after it started (restarts used up, the disk full) raises `distrain.RunFailed`.
    `strategy="auto"`: as `distrain run --strategy auto`, a short calibration on this cluster picks the
    strategy, transport and settings; config.yaml, summary.json["strategy_auto"] and prediction.json in
    the run directory record the choice and its reason.
    """
    from distrain.orchestrator.auto_strategy import make_concrete
    from distrain.orchestrator.run import run_training
    from distrain.orchestrator.tasks import attach_task_object

    valid = RunConfig.field_names(options) + [n for n in known_option_fields() if n not in RunConfig.field_names()]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    handler = on_event or (_print_progress if progress else None)
    if resume is not None:
        if task is not None or config is not None:
            raise ConfigError("resume continues a run with its own task and config.yaml; drop task= and config=")
        from distrain.orchestrator.auto_strategy import resumed_values
        from distrain.orchestrator.resume import resume_config

        cfg = resume_config(resume, resumed_values(resume, options))
        result = run_training(cfg, handler, resume=True, callbacks=callbacks)
        return FitResult(result.run_dir, result.summary)
    if "task" in options:
        raise ConfigError("pass the task as fit(task=...), not as an option")
    task_path, task_object = _task_reference(task)
    if task_object is not None and options.get("task_args"):
        raise ConfigError("task_args build a task from its class; pass them to your task's constructor instead")
    overrides = dict(options) | ({"task": task_path} if task_path else {})
    config_file = str(config) if config else None
    # strategy="auto": calibrate and choose, as `distrain run --strategy auto` does (the same code)
    say = _print_line if progress and on_event is None else _quiet
    overrides, auto = make_concrete(overrides, config_file, say, task_object)
    cfg = RunConfig.resolve(config_file, overrides)
    if task_object is not None:
        attach_task_object(cfg, task_object)
    result = run_training(cfg, handler, callbacks=callbacks, auto=auto)
    return FitResult(result.run_dir, result.summary)


def _task_reference(task: Any) -> tuple[str, Any]:
    """(import path to record, object to ship): a path is recorded as given; a class or instance whose
    class can be imported again is recorded by its path; anything else is shipped to the workers as an
    object (by cloudpickle) and recorded as not repeatable."""
    from distrain.trainers.task import Task

    if task is None:
        return "", None
    if isinstance(task, str):
        return task, None
    cls = task if isinstance(task, type) else type(task)
    if not issubclass(cls, Task):
        raise ConfigError(f"task must be a distrain.Task subclass, instance or import path, got {cls.__name__}")
    path = importable_path(cls)
    if isinstance(task, type) and path:
        return path, None
    return f"object:{cls.__qualname__}", task


def importable_path(cls: type) -> str | None:
    """`module:Name` or `/abs/file.py:Name` that imports `cls` again in another process; None when the
    class lives in `__main__` (a notebook or script) or inside a function."""
    if "<locals>" in cls.__qualname__:
        return None
    module = inspect.getmodule(cls)
    if module is None or module.__name__ == "__main__":
        return None
    if module.__name__.startswith("distrain_user_") and getattr(module, "__file__", None):
        return f"{Path(module.__file__).resolve()}:{cls.__qualname__}"
    return f"{module.__name__}:{cls.__qualname__}"


def _quiet(line: str) -> None:
    pass


def _print_line(line: str) -> None:
    print(f"distrain: {line}")


def _print_progress(event: Any) -> None:
    from distrain.orchestrator.run import Notice, Progress, RunStarted

    if isinstance(event, Notice):
        print(f"distrain: note: {event.text}")
    elif isinstance(event, RunStarted):
        print(f"distrain: run {event.run_dir} ({event.total_steps} steps, {event.num_params:,} parameters)")
    elif isinstance(event, Progress) and event.evaluated:
        figures = "  ".join(f"test_{k} {v:.4g}" for k, v in event.test_metrics.items())
        print(f"epoch {event.epoch + 1}/{event.epochs}  step {event.steps_done}/{event.total_steps}  {figures}")
