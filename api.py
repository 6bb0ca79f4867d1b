"""The public Python API: `distrain.fit(...)` trains a task with a strategy and returns a `FitResult`.

    import distrain
    result = distrain.fit(task=MyTask(), strategy="local-sgd", adaptive_tau=True, workers=4)
    result.metrics["val_loss"], result.metrics["test_loss"], result.run_dir, result.summary

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
from distrain.plugins import USER_MODULE_PREFIX, is_lone_module


@dataclass
class FitResult:
    """What a finished run left: its directory and its `summary.json` figures."""

    run_dir: Path
    summary: dict[str, Any]

    @property
    def metrics(self) -> dict[str, float | None]:
        """The last evaluation's figures by column: the validation split's (`val_loss`, `val_accuracy`, ...)
        and the test set's (`test_loss`, `test_accuracy`, ...), reported apart."""
        return {
            k.removeprefix("final_"): v for k, v in self.summary.items() if k.startswith(("final_val_", "final_test_"))
        }

    @property
    def best_checkpoint(self) -> Path | None:
        """checkpoints/best.pt of a run with `checkpoint_best="val_loss"` (or another metric): the checkpoint
        of its best evaluation (`summary["best_checkpoint"]` says which); None without one.
        `distrain.load_model(result.best_checkpoint)` gives its model."""
        from distrain.orchestrator.best_checkpoint import best_of

        best = best_of(self.run_dir)
        return None if best is None else Path(best["path"])

    @property
    def status(self) -> str:
        return str(self.summary.get("status"))

    def model(self) -> Any:
        """The task's model with the run's final weights (a stopped run's: its last checkpoint's), on the
        CPU and in eval mode (`distrain.load_model(run_dir)`)."""
        from distrain.orchestrator.trained_model import load_model

        return load_model(self.run_dir)


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

    plain_ray_logs_when_piped()  # a script's output sent to a file or a pipe: no colour codes in it

    valid = RunConfig.field_names(options) + [n for n in known_option_fields() if n not in RunConfig.field_names()]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    handler = on_event or (_print_progress if progress else None)
    if resume is not None:
        if task is not None or config is not None:
            raise ConfigError("resume continues a run with its own task and config.yaml; drop task= and config=")
        return train(prepare_resume(resume, options), handler, callbacks=callbacks, keep_ray=True)
    if "task" in options:
        raise ConfigError("pass the task as fit(task=...), not as an option")
    task_path, task_args, task_object = _task_reference(task)
    if options.get("task_args") and (task_object is not None or not isinstance(task, str | type | None)):
        raise ConfigError("task_args build a task from its import path; pass them to your task's constructor instead")
    overrides = dict(options) | ({"task": task_path} if task_path else {})
    if task_args:  # an instance's constructor arguments
        overrides["task_args"] = task_args
    say = _print_line if progress and on_event is None else _quiet
    run = prepare(str(config) if config else None, overrides, say=say, task_object=task_object)
    return train(run, handler, callbacks=callbacks, keep_ray=True)


@dataclass(frozen=True)
class PreparedRun:
    """A run's spec, checked, and how it starts: what `prepare` and `prepare_resume` build and `train` runs."""

    config: RunConfig
    auto: dict[str, Any] | None = None  # --strategy auto: the record of the choice (planning/auto_strategy.py)
    resume: bool = False  # go on from the run directory's latest checkpoint


def prepare(
    config_file: str | None,
    overrides: dict[str, Any],
    *,
    say: Callable[[str], None] = lambda line: None,
    task_object: Any = None,
) -> PreparedRun:
    """The spec of a new run: defaults < the YAML file < `overrides` (those not None), with `strategy
    auto` made concrete first (a short calibration; `say` reports it). `fit` calls this after reading its
    arguments, `distrain run` after reading its flags: one code path. A config file that names a run
    directory already holding a run (a finished run's config.yaml, repeated) gets a fresh default one."""
    from distrain.planning.auto_strategy import make_concrete

    if config_file and overrides.get("run_dir") is None:
        recorded = RunConfig.load_yaml(config_file).get("run_dir") or ""
        if recorded and Path(recorded).is_dir() and any(Path(recorded).iterdir()):
            overrides = dict(overrides, run_dir="")
            say(f"{recorded} already holds a run; the repeat gets a new run directory")
    overrides, auto = make_concrete(overrides, config_file, say, task_object)
    config = RunConfig.resolve(config_file, overrides)  # loads torch
    if task_object is not None:
        from distrain.orchestrator.tasks import attach_task_object  # loads torch

        attach_task_object(config, task_object)
    return PreparedRun(config, auto)


def prepare_resume(run_dir: str | Path, overrides: dict[str, Any]) -> PreparedRun:
    """The spec of a run resumed from `run_dir`: its config.yaml with only resumable `overrides` changed
    (`strategy auto` read as the strategy the run chose), checked against its latest checkpoint."""
    from distrain.orchestrator.resume import resume_config
    from distrain.orchestrator.storage import download, is_uri, parent_uri
    from distrain.planning.auto_strategy import resumed_values

    if is_uri(run_dir):  # a run kept on --storage: resumed from a local copy, synced back to where it was
        uri = str(run_dir)
        run_dir = download(uri, "--resume")
        if overrides.get("storage") is None:
            overrides = dict(overrides, storage=parent_uri(uri))
    return PreparedRun(resume_config(run_dir, resumed_values(run_dir, overrides)), resume=True)


def train(
    run: PreparedRun,
    on_event: Callable[[Any], None] | None = None,
    *,
    callbacks: list[Any] | None = None,
    keep_ray: bool = False,
) -> FitResult:
    """Train a prepared run; `on_event` gets its events, `callbacks` its hooks. `fit` and `distrain run`
    both end here (Ray loads only from here on). `keep_ray` (fit): a local Ray this run starts stays up
    for the next run in the process, until it exits; `distrain run` stops the Ray it started."""
    from distrain.orchestrator.run import run_training

    result = run_training(
        run.config, on_event, resume=run.resume, callbacks=callbacks, auto=run.auto, keep_ray=keep_ray
    )
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
    if module.__name__.startswith(USER_MODULE_PREFIX) or is_lone_module(module):
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
        figures = "  ".join(f"{k} {v:.4g}" for k, v in event.figures.items())
        print(f"epoch {event.epoch + 1}/{event.epochs}  step {event.steps_done}/{event.total_steps}  {figures}")
