"""`distrain tune`: the sweep's own options (what to sweep, how to search), the run options every trial
shares (generated from the config's fields), a large sweep confirmed first, then Ray Tune under the
live trial table (sweep_display.py) and the results table."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from distrain.commands import console as consoles
from distrain.commands.console import say, warn
from distrain.commands.help_texts import TUNE_HELP
from distrain.commands.options import own_option, parse_task_args, run_options
from distrain.commands.run_display import describe_task
from distrain.errors import DistrainError
from distrain.orchestrator import interrupts

try:  # typer >= 0.24 keeps Abort in typer.exceptions
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover - older typer on the real click
    from click.exceptions import Abort  # type: ignore[no-redef,assignment]

HELP = TUNE_HELP

# The run options every trial of a sweep shares (a sweep flag or --param varies the others).
SHARED_RUN_OPTIONS = (
    "epochs", "task", "task_args", "target", "model", "dataset", "data_dir", "cpus_per_worker", "base_batch_size",
    "target_accuracy", "val_fraction", "seed", "address",
)  # fmt: skip

# Sweep flags: each names one RunConfig field and takes a list (a,b,c) or, for real values, a range
# (LOW:HIGH or LOW:HIGH:log, random search only).
SWEPT_FLAGS = {
    "batch_sizes": ("batch_size", "--batch-sizes"),
    "lr": ("lr", "--lr"),
    "lr_scaling": ("lr_scaling", "--lr-scaling"),
    "warmup_epochs": ("warmup_epochs", "--warmup-epochs"),
    "workers": ("workers", "--workers"),
    "strategies": ("strategy", "--strategies"),
}


def strategy_sweep_flags() -> dict[str, str]:
    """The sweep flags the built-in strategies declare for their own options (`Strategy.sweep_flags`):
    option -> help. Each names one option and goes only to the trials of a strategy that reads it."""
    from distrain.strategies import STRATEGIES

    flags: dict[str, str] = {}
    for name in STRATEGIES.names():
        flags.update(STRATEGIES.get(name).sweep_flags)
    return flags


def swept_flags() -> dict[str, tuple[str, str]]:
    """Every sweep flag: argument -> (the RunConfig field it varies, the flag as typed)."""
    owned = {name: (name, "--" + name.replace("_", "-")) for name in strategy_sweep_flags()}
    return {**SWEPT_FLAGS, **owned}


# A sweep of more trials than this asks first (or takes --yes). A 4 x 4 x 2 grid (docs/sweeps.md's example is
# 24 trials) is deliberate and starts at once; what this catches is the accident: one more axis than
# meant, --num-samples 500, a list typed with an extra value, each worth hours of cluster time.
CONFIRM_ABOVE = 32


def parameters() -> list[inspect.Parameter]:
    """`tune`'s own options (sweep, search, where), and the run options the trials share."""

    def sweep(name: str, kind: Any, help: str) -> inspect.Parameter:
        return own_option(name, kind, None, help=help, show_default=False, rich_help_panel="sweep")

    def search(name: str, kind: Any, default: Any, help: str) -> inspect.Parameter:
        return own_option(name, kind, default, help=help, rich_help_panel="search")

    return [
        own_option("config", Path | None, None, "--config", help="Base run config (YAML) every trial starts from."),
        sweep("batch_sizes", str | None, "Per-worker batch sizes, e.g. 16,32,64,128."),
        sweep("lr", str | None, "Base learning rates: a list (0.01,0.1) or a range (0.01:0.5:log)."),
        sweep("lr_scaling", str | None, "LR scaling rules vs --base-batch-size: linear,sqrt,none."),
        sweep("warmup_epochs", str | None, "Warmup epochs: a list (0,1) or a range (0:2)."),
        sweep("workers", str | None, "Worker counts per trial, e.g. 2,4."),
        sweep("strategies", str | None, "Strategies, e.g. bsp,ssp."),
        *(sweep(name, str | None, text) for name, text in strategy_sweep_flags().items()),
        sweep("param", list[str] | None, "NAME=VALUES for any other config field (repeatable), e.g. momentum=0.8,0.9."),
        search("search", str, "grid", "grid (every combination) or random (--num-samples draws)."),
        search("num_samples", int, 1, "Random search: trials to draw; grid search: repeats of the grid."),
        search("scheduler", str, "none", "none, or asha: stop trials whose accuracy lags at a rung."),
        search("grace_period", int, 1, "ASHA: epochs every trial runs before it can be stopped."),
        search("max_concurrent_trials", int, 0, "At most this many trials at once (0: as many as the cluster holds)."),
        search("time_budget", float, 0.0, "Stop the sweep after this many seconds (0: no limit)."),
        search(
            "objective",
            str,
            "time_to_target",
            "time_to_target (ascending; then the final metric) or final_metric: the final value of the target "
            "metric (--target, or the task's), best first (final_accuracy: the same, its older name).",
        ),
        *run_options(only=SHARED_RUN_OPTIONS),
        own_option(
            "cluster_cpus", int, 0, help="Local Ray only: logical CPUs (default: this machine's, at least one trial's)."
        ),
        own_option(
            "sweep_dir",
            str | None,
            None,
            help="Sweep directory (default sweep/<timestamp>-tune); must be new or empty.",
        ),
        own_option(
            "resume",
            Path | None,
            None,
            help="Go on with an interrupted sweep directory (its own settings; no sweep flags).",
        ),
        own_option(
            "yes",
            bool,
            False,
            "--yes",
            "-y",
            help=f"Start a sweep of more than {CONFIRM_ABOVE} trials without asking (needed without a terminal).",
            rich_help_panel="search",
        ),
    ]


def confirm_large_sweep(header: str, num_trials: int, stdin_is_terminal: bool) -> None:
    """Ask on a terminal. Without one (CI, cron, nohup) nobody can answer, so the sweep is refused rather
    than started: a script that means a large sweep says --yes."""
    if not stdin_is_terminal:
        raise DistrainError(
            f"this sweep has {num_trials} trials (more than {CONFIRM_ABOVE}) and there is no terminal to confirm "
            "it on; add --yes to start it"
        )
    say(header)
    try:
        start = typer.confirm(f"start {num_trials} trials?", default=False)
    except Abort:  # end of input
        start = False
    if not start:
        warn("sweep not started; nothing written")
        raise typer.Exit(1)


def tune(
    *,
    stdin_is_terminal: Callable[[], bool],
    config: Path | None,
    param: list[str] | None,
    search: str,
    num_samples: int,
    scheduler: str,
    grace_period: int,
    max_concurrent_trials: int,
    time_budget: float,
    objective: str,
    cluster_cpus: int,
    sweep_dir: str | None,
    resume: Path | None,
    yes: bool,
    task_arg: list[str] | None = None,
    **flags: Any,
) -> None:
    """The sweep: `flags` are the sweep flags (`swept_flags()`) and the shared run options."""
    from distrain.tuning.sweep_spec import (
        SweepSpec,
        parse_dimension,
        parse_param,
        plugin_strategies,
        sweep_base,
    )

    every_flag = swept_flags()
    swept = {arg: flags.pop(arg) for arg in every_flag}
    dimensions: dict[str, Any] = {}
    for arg, (name, flag) in every_flag.items():
        if swept[arg] is not None:
            dimensions[name] = parse_dimension(name, swept[arg], flag)
    if "strategy" in dimensions:  # strategies named by path: absolute (trials run elsewhere), and loaded, so
        dimensions["strategy"] = plugin_strategies(dimensions["strategy"])  # their options can be swept
    for spec_text in param or []:
        name, dim = parse_param(spec_text)
        if name in dimensions:
            raise DistrainError(f"--param {name} repeats a sweep flag; give {name} once")
        dimensions[name] = dim
    base_flags = dict(flags, task_args=parse_task_args(task_arg) if task_arg else None)
    if resume is not None:
        from distrain.tuning.tune import load_spec

        given = [k for k, v in base_flags.items() if v is not None]
        if dimensions or config is not None or sweep_dir or given:
            raise DistrainError("--resume continues a sweep with its own settings; drop the other sweep flags")
        if not (resume / "sweep.json").is_file() or not (resume / "tune").is_dir():
            raise DistrainError(f"--resume {str(resume)!r} is not a sweep directory (no sweep.json and tune/)")
        spec = load_spec(resume)
        where = resume
    else:
        spec = SweepSpec(
            base=sweep_base(str(config) if config else None, base_flags),
            dimensions=dimensions,
            search=search,
            num_samples=num_samples,
            scheduler=scheduler,
            grace_period=grace_period,
            max_concurrent_trials=max_concurrent_trials,
            time_budget_s=time_budget,
            objective=objective,
        )
        spec.validate()
        from distrain.orchestrator.files import fresh_dir, timestamped

        where = fresh_dir(sweep_dir, timestamped(Path("sweep"), "tune"), "--sweep-dir")
    spec.check_cluster_cpus(cluster_cpus)

    # The sweep's size, before Ray starts (and before a large one starts at all).
    header = (
        f"sweep {where}  |  {spec.num_trials()} trial(s), {spec.search} search, scheduler {spec.scheduler}"
        f"  |  {describe_task(spec.base_config)}, {spec.base_config.epochs} epoch(s) each"
    )
    if resume is None and spec.num_trials() > CONFIRM_ABOVE and not yes:
        confirm_large_sweep(header, spec.num_trials(), stdin_is_terminal())
    else:
        say(header)

    from distrain.sweep_display import SweepDisplay, print_table, results_table
    from distrain.tuning.tune import run_sweep  # Ray, Tune and torch load only from here on

    try:
        with SweepDisplay(consoles.out, spec.num_trials(), spec.time_budget_s) as display:
            sweep = run_sweep(spec, where, display.on_event, resume=resume is not None, cluster_cpus=cluster_cpus)
    except KeyboardInterrupt:  # a second Ctrl-C, or SIGTERM: the trials were killed with Ray
        warn(sweep_interrupted_line(Path(where).absolute(), None))
        raise typer.Exit(interrupts.exit_code()) from None
    if sweep.interrupted:  # Ctrl-C: Tune stopped the trials and saved its state
        warn(sweep_interrupted_line(sweep.sweep_dir, sweep.results))
        raise typer.Exit(interrupts.exit_code())
    title = f"distrain tune: {len(sweep.results)} trial(s), best first by {spec.objective}"
    width = consoles.out.width if consoles.out.is_terminal else None  # a log gets the table at its natural width
    print_table(consoles.out, results_table(sweep.results, list(spec.dimensions), title, width=width))
    say(f"sweep took {sweep.wall_time_s:.1f} s")
    unfinished = sweep.results["status"].isin(["stopped", "pending"]).sum() if len(sweep.results) else 0
    if unfinished and (spec.scheduler == "none" or (sweep.results["status"] == "pending").any()):
        say(f"{unfinished} trial(s) did not finish; go on with: distrain tune --resume {sweep.sweep_dir}")
    say(f"results in {sweep.sweep_dir}/ (results.parquet, results.csv, trials/)")
    failed = sweep.results[sweep.results["status"] == "error"] if len(sweep.results) else sweep.results
    for _, row in failed.iterrows():
        warn(f"trial {row['trial_id']} failed: {row['error']}")
    if sweep.best is None:
        warn("no trial ran to a result; nothing to recommend")
        raise typer.Exit(1)
    say(f"best config: {sweep.sweep_dir}/best.yaml  (repeat it: distrain run --config {sweep.sweep_dir}/best.yaml)")


def sweep_interrupted_line(sweep_dir: Path, results: Any) -> str:
    what = f"interrupted ({interrupts.name()})"
    if not (sweep_dir / "sweep.json").is_file() or not (sweep_dir / "tune").is_dir():
        return f"{what} before the sweep started: nothing to go on with"
    done = ""
    if results is not None:
        finished = int((results["status"] == "completed").sum()) if len(results) else 0
        done = f" {finished} trial(s) finished, results so far in {sweep_dir}/;"
    return f"{what}:{done} go on with: distrain tune --resume {sweep_dir}"
