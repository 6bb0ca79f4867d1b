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
from distrain.plugins import is_lone_module


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
    from distrain.orchestrator.remote_errors import plain_ray_logs_when_piped
    from distrain.orchestrator.run import run_training
    from distrain.orchestrator.tasks import attach_task_object
    from distrain.planning.auto_strategy import make_concrete

    plain_ray_logs_when_piped()  # a script's output sent to a file or a pipe: no colour codes in it

    valid = RunConfig.field_names(options) + [n for n in known_option_fields() if n not in RunConfig.field_names()]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    handler = on_event or (_print_progress if progress else None)
    if resume is not None:
        if task is not None or config is not None:
            raise ConfigError("resume continues a run with its own task and config.yaml; drop task= and config=")
        from distrain.orchestrator.resume import resume_config
        from distrain.planning.auto_strategy import resumed_values

        cfg = resume_config(resume, resumed_values(resume, options))
        result = run_training(cfg, handler, resume=True, callbacks=callbacks)
        return FitResult(result.run_dir, result.summary)
    if "task" in options:
        raise ConfigError("pass the task as fit(task=...), not as an option")
    task_path, task_args, task_object = _task_reference(task)
    if options.get("task_args") and (task_object is not None or not isinstance(task, str | type | None)):
        raise ConfigError("task_args build a task from its import path; pass them to your task's constructor instead")
    overrides = dict(options) | ({"task": task_path} if task_path else {})
    if task_args:  # an instance's constructor arguments
        overrides["task_args"] = task_args
    config_file = str(config) if config else None
    # strategy="auto": calibrate and choose, as `distrain run --strategy auto` does (the same code)
    say = _print_line if progress and on_event is None else _quiet
    overrides, auto = make_concrete(overrides, config_file, say, task_object)
    cfg = RunConfig.resolve(config_file, overrides)
    if task_object is not None:
        attach_task_object(cfg, task_object)
    result = run_training(cfg, handler, callbacks=callbacks, auto=auto)
    return FitResult(result.run_dir, result.summary)


def _task_reference(task: Any) -> tuple[str, dict[str, Any] | None, Any]:
    """(import path to record, its task_args, object to ship). A path is recorded as given. A class, or an
    instance whose constructor call is known (trainers/task_call.py), whose class can be imported again,
    is recorded as its path and constructor arguments: workers, --resume and --config build it from them.
    Anything else (a class in a notebook's __main__, an argument YAML cannot hold, an attribute set after
    construction) is shipped to the workers as the object itself (by cloudpickle), recorded as
    `object:Name`, and kept in the run directory's task.pkl for --resume."""
    from distrain.trainers.task import Task
    from distrain.trainers.task_call import constructor_arguments

    if task is None:
        return "", None, None
    if isinstance(task, str):
        return task, None, None
    cls = task if isinstance(task, type) else type(task)
    if not issubclass(cls, Task):
        raise ConfigError(f"task must be a distrain.Task subclass, instance or import path, got {cls.__name__}")
    path = importable_path(cls)
    if isinstance(task, type):
        return (path, None, None) if path else (f"object:{cls.__qualname__}", None, cls())
    arguments = constructor_arguments(task) if path else None
    if path and arguments is not None:
        return path, arguments or None, None
    return f"object:{cls.__qualname__}", None, task


def importable_path(cls: type) -> str | None:
    """`module:Name` or `/abs/file.py:Name` that imports `cls` again in another process; None when the
    class lives in `__main__` (a notebook or script) or inside a function."""
    if "<locals>" in cls.__qualname__:
        return None
    module = inspect.getmodule(cls)
    if module is None or module.__name__ == "__main__":
        return None
    # A package or a module in one is imported by name; a lone file (`from my_task import Regression`,
    # next to a notebook) by its path, so that `distrain run --resume` from another folder still finds it.
    if module.__name__.startswith("distrain_user_") or is_lone_module(module):
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
