"""`distrain run`: its options (every run option, generated), its flags made into overrides, then the
API's one front door (`api.prepare` or `api.prepare_resume`, then `api.train`: what `distrain.fit`
calls too) under the run's display; the closing table, and the exit code of a diverged run."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

import typer
from rich.text import Text

from distrain.commands import console as consoles
from distrain.commands.help_texts import DIVERGED_EXIT_CODE, EXIT_CODES  # noqa: F401 (docs/flags.md)
from distrain.commands.help_texts import RUN_HELP as HELP  # noqa: F401 (the command's help, as plan.HELP)
from distrain.commands.options import own_option, parse_task_args, run_options
from distrain.commands.run_display import RunDisplay
from distrain.commands.run_summary import print_summary
from distrain.config import parse_optimizer_args
from distrain.errors import DistrainError


def parameters(plugin_values: dict[str, Any]) -> list[inspect.Parameter]:
    """`run`'s own options (--config, --resume) around every run option: every section's, every
    built-in strategy's options, and those of a strategy (task) named by import path in `plugin_values`."""
    return [
        own_option(
            "config", Path | None, None, "--config", help="YAML file of config keys; flags given here override it."
        ),
        *run_options(plugin_values=plugin_values),
        own_option(
            "resume",
            str | None,  # not a Path: a --storage URI (s3://...) would lose a slash
            None,
            "--resume",
            help="Continue the run in this directory from its latest checkpoint (e.g. after its driver was killed); "
            "only length, evaluation, checkpoint, timeout, fault and resource flags may change.",
            show_default=False,
            rich_help_panel="checkpointing",
        ),
    ]


def run(
    config: Path | None = None,
    resume: str | None = None,
    task_arg: list[str] | None = None,
    optimizer_arg: list[str] | None = None,
    run_dir: str | None = None,
    **flags: Any,
) -> None:
    overrides = dict(flags, run_dir=run_dir)
    overrides["task_args"] = parse_task_args(task_arg) if task_arg else None
    overrides["optimizer_args"] = parse_optimizer_args(optimizer_arg) if optimizer_arg else None
    if resume is not None and config is not None:
        raise DistrainError("--resume uses the run's own config.yaml; drop --config")
    from distrain.orchestrator import ray_start, startup

    try:
        from distrain import api  # the front door a notebook uses too: one code path from the spec on

        # The display first: torch and Ray take seconds to load, the settings' checks among them.
        with RunDisplay(run_dir=str(resume) if resume is not None else overrides.get("run_dir") or "") as display:
            if resume is not None:
                prepared = api.prepare_resume(resume, overrides)
            else:
                with _early_ray(str(config) if config else None, overrides):
                    prepared = api.prepare(str(config) if config else None, overrides, say=display.say)
            display.configured(prepared.config)
            result = api.train(prepared, display.on_event)
    finally:
        ray_start.discard()  # begun and never taken: the run ended before it needed Ray
    print_summary(result.summary, result.run_dir)
    clock = startup.current()
    line = clock.line() if clock is not None else None
    if line is not None:
        consoles.say(line)
    exit_if_diverged(result.summary)


def _early_ray(config_file: str | None, overrides: dict[str, Any]) -> Any:
    """A new run's local Ray begins once its torch-free checks pass, while torch loads (ray_start.py);
    not under --strategy auto, whose calibration starts the Ray it measures on."""
    from distrain.config.checks import before_torch
    from distrain.orchestrator import ray_start
    from distrain.planning.auto_strategy import requested

    if requested(overrides, config_file):
        return contextlib.nullcontext()
    return before_torch(lambda config: ray_start.begin(config, _start_local_ray, _stop_local_ray))


def _start_local_ray(config: Any) -> int:  # on ray_start's thread: Ray loads there, not here
    from distrain.orchestrator import cluster

    return cluster.start_local_ray_for(config)


def _stop_local_ray() -> None:
    from distrain.orchestrator import cluster

    cluster.stop_local_ray()


def exit_if_diverged(summary: dict[str, Any]) -> None:
    """A diverged run (stopped by --on-nonfinite stop, or judged at its end: too many updates skipped, a
    final evaluation that is not finite): one line on stderr that says why, and exit code 3."""
    if summary.get("status") != "diverged":
        return
    from distrain.orchestrator.outcome import diverged_line

    line = Text("error: ", style="bold red") + Text(diverged_line(summary["diverged"]))
    consoles.err.print(line, highlight=False)
    raise typer.Exit(DIVERGED_EXIT_CODE)
