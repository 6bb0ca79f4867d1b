"""The `distrain` command line: flags and YAML into a `RunConfig`, progress and summaries out.

Every user-facing problem (`DistrainError`) becomes one line on stderr and its exit code (`EXIT_CODES`:
2 for bad input). This module knows neither Ray nor torch: the orchestrator is imported only when a
command needs it, which also keeps `distrain --help` fast.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
from rich.spinner import Spinner
from rich.table import Column, Table
from rich.text import Text
from typer.core import TyperCommand

from distrain.config import RunConfig, parse_optimizer_args
from distrain.errors import DistrainError, RunFailed
from distrain.fields import SECTIONS, FieldInfo
from distrain.orchestrator import interrupts
from distrain.run_progress import Heartbeat, RunClock, clock_text, heartbeat_seconds
from distrain.units import size_text

try:  # typer >= 0.24 parses with its own vendored copy of click (and keeps Abort in typer.exceptions)
    from typer._click import exceptions as click_exceptions
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover - older typer on the real click
    from click import exceptions as click_exceptions  # type: ignore[no-redef]
    from click.exceptions import Abort  # type: ignore[no-redef,assignment]

app = typer.Typer(
    name="distrain",
    help="Distributed SGD on Ray: BSP, async and SSP parameter servers, local SGD, one flag apart.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

F = TypeVar("F", bound=Callable[..., Any])
HELP = {name: RunConfig.field_info(name).help for name in RunConfig.field_names()}


def user_errors(fn: F) -> F:
    """Turn a DistrainError into one line and its exit code (2 for bad input, 4 for a run that failed);
    Ctrl-C or SIGTERM into one line and exit code 130 or 143 (orchestrator/interrupts.py)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DistrainError as e:
            err.print(Text("error: ", style="bold red") + Text(str(e)), highlight=False)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:
            err.print(_interrupted_line(getattr(e, "run_dir", None)), markup=False, highlight=False)
            raise typer.Exit(interrupts.exit_code()) from None

    return wrapper  # type: ignore[return-value]


def _interrupted_line(run_dir: Path | None) -> str:
    """What an interruption left: a run directory is named only if there is one."""
    what = f"interrupted ({interrupts.name()})"
    if run_dir is None or not run_dir.is_dir():
        return f"{what} before the run started: nothing was written"
    summary = run_dir / "summary.json"
    status = json.loads(summary.read_text()).get("status") if summary.is_file() else None
    if status == "completed":  # the signal came as the run was being recorded
        return f"{what} as the run ended: it completed; results in {run_dir}/"
    line = f"{what}: workers stopped; what was recorded so far is in {run_dir}/"
    if (run_dir / "checkpoints" / "latest.json").is_file():
        line += f"; go on with: distrain run --resume {run_dir}"
    return line


def _shown_default(field: str | FieldInfo) -> str | bool:
    """The default `--help` shows for a config field (the flags themselves default to None: not given)."""
    info = RunConfig.field_info(field) if isinstance(field, str) else field
    value = info.default
    if info.shown:
        return str(info.shown)
    if value is None:  # resolved per strategy: the help text states the effective default
        return False
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in ("", (), [], {}):
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _opt(field: str | FieldInfo, *decls: str, **kwargs: Any) -> Any:
    """A config field's flag, in its section's help panel, its default at the end of its help text (the
    text wraps with it, where typer's own default goes on a line of its own)."""
    info = RunConfig.field_info(field) if isinstance(field, str) else field
    shown = _shown_default(info)
    text = info.help + (" " + escape(f"[default: {shown}]") if shown else "")
    section = info.section
    return typer.Option(*decls, help=text, show_default=False, rich_help_panel=section, **kwargs)


class SectionedCommand(TyperCommand):
    """A command whose help lists the options panel by panel, in `SECTIONS` order (typer orders panels by
    first appearance), and names each on/off flag once: a column of `--no-...` forms leaves no room at 80
    columns, so the command's help says once that every such flag has one."""

    def get_params(self, ctx: Any) -> list[Any]:
        order = {name: i for i, name in enumerate(SECTIONS)}
        return sorted(super().get_params(ctx), key=lambda p: order.get(getattr(p, "rich_help_panel", None), -1))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        negations = {p: p.secondary_opts for p in self.params if getattr(p, "secondary_opts", None)}
        try:
            for p in negations:
                p.secondary_opts = []
            super().format_help(ctx, formatter)
        finally:
            for p, opts in negations.items():
                p.secondary_opts = opts


def _version() -> str:
    try:
        return importlib.metadata.version("distrain")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        from distrain import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        out.print(f"distrain {_version()}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_print_version, is_eager=True, show_default=False
        ),
    ] = False,
) -> None:
    """Distributed SGD on Ray: BSP, async and SSP parameter servers, local SGD, one flag apart."""


PY_TYPES: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str, "list[str]": list[str]}


def _field_parameter(info: FieldInfo) -> inspect.Parameter:
    """One config field as a `run` flag: optional (None: not given), in its section's help panel."""
    if info.name == "task_args" and "task" in _PLUGIN_VALUES:
        from distrain.orchestrator.tasks import describe_task_args

        info = dataclasses.replace(info, help=f"{info.help} {describe_task_args(_PLUGIN_VALUES['task'])}")
    kind = info.kind.removesuffix(" | None")
    py = list[str] if kind == "dict[str, Any]" else PY_TYPES[kind]  # KEY=VALUE, one per use
    if info.name == "workers":  # N or MIN..MAX: config.parse_workers reads both (as it does YAML's)
        py = str
    name = info.flag.removeprefix("--").replace("-", "_")
    decls = (info.flag,) if name != info.name else ()
    extra = {"metavar": info.metavar} if info.metavar else {}
    option = _opt(info, *decls, **extra)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[py | None, option]
    )


def _run_parameters() -> list[inspect.Parameter]:
    config = typer.Option("--config", help="YAML file of config keys; flags given here override it.")
    resume = typer.Option(
        "--resume",
        help="Continue the run in this directory from its latest checkpoint (e.g. after its driver was killed); "
        "only length, evaluation, checkpoint, timeout, fault and resource flags may change.",
        show_default=False,
        rich_help_panel="checkpointing",
    )
    keyword = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter("config", keyword, default=None, annotation=Annotated[Path | None, config]),
        *(
            _field_parameter(RunConfig.field_info(name, _PLUGIN_VALUES))
            for name in RunConfig.field_names(_PLUGIN_VALUES)
        ),
        inspect.Parameter("resume", keyword, default=None, annotation=Annotated[Path | None, resume]),
    ]


def _register_run() -> None:
    """(Re)build the `run` command from the config's fields: every section's, every built-in strategy's
    options, and the options of a strategy named by import path on the command line (`main`)."""

    def run(**flags: Any) -> None:
        """Train one model with one strategy; writes runs/<id>/ (config, metrics, summary, checkpoints).

        Every on/off flag also has a --no- form (e.g. --no-staleness-lr) that turns off what --config turns on.
        """
        _run(**flags)

    codes = ", ".join(f"{code} {what}" for code, what in EXIT_CODES.items())
    run.__doc__ = f"{inspect.cleandoc(run.__doc__ or '')}\n\nExit codes: {codes}."

    params = _run_parameters()
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    before = list(app.registered_commands)
    app.command("run", cls=SectionedCommand)(user_errors(run))
    new = app.registered_commands.pop()
    at = next((i for i, c in enumerate(before) if c.name == "run"), 0)  # first in `distrain --help`
    app.registered_commands[:] = [*before[:at], new, *(c for c in before[at:] if c.name != "run")]


# A strategy named by import path on the command line (`main` looks before parsing): its options become flags.
_PLUGIN_VALUES: dict[str, Any] = {}


def _run(
    config: Path | None = None,
    resume: Path | None = None,
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
    from distrain import api  # the front door a notebook uses too: one code path from the spec on

    # The display first: torch and Ray take seconds to load, the settings' checks among them.
    with RunDisplay(run_dir=str(resume) if resume is not None else overrides.get("run_dir") or "") as display:
        if resume is not None:
            prepared = api.prepare_resume(resume, overrides)
        else:
            prepared = api.prepare(str(config) if config else None, overrides, say=display.say)
        display.configured(prepared.config)
        result = api.train(prepared, display.on_event)
    print_summary(result.summary, result.run_dir)
    _exit_if_diverged(result.summary)


DIVERGED_EXIT_CODE = 3  # not 2: files were written (the metrics, the summary); not 1: no bug either
# What `distrain run` exits with (README "Exit codes", and `distrain run --help`). 1 is left to bugs
# (a traceback, the worker's own error among them).
EXIT_CODES = {
    0: "completed",
    2: "bad input",
    DIVERGED_EXIT_CODE: "diverged",
    RunFailed.exit_code: "failed after it started (--max-failures used up, disk full)",
    130: "interrupted (SIGINT)",
    143: "interrupted (SIGTERM)",
}


def _exit_if_diverged(summary: dict[str, Any]) -> None:
    """A diverged run (stopped by --on-nonfinite stop, or judged at its end: too many updates skipped, a
    final evaluation that is not finite): one line on stderr that says why, and exit code 3."""
    if summary.get("status") != "diverged":
        return
    from distrain.orchestrator.outcome import diverged_line

    err.print(Text("error: ", style="bold red") + Text(diverged_line(summary["diverged"])), highlight=False)
    raise typer.Exit(DIVERGED_EXIT_CODE)


def _short(strategy: str) -> str:
    """A strategy as tables show it: its name, or a plugin's file and class (not the whole path)."""
    return strategy.rpartition("/")[2]


def describe_task(cfg: RunConfig) -> str:
    """ "cnn on digits" for the built-in task, else the task's class name."""
    if not cfg.task:
        return f"{cfg.model} on {cfg.dataset}"
    return cfg.task.rpartition(":")[2]


def parse_task_args(items: list[str]) -> dict[str, Any]:
    """["key=value", ...] -> {key: value}, each value read as YAML (numbers, booleans, lists)."""
    import yaml

    args: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise DistrainError(f"--task-arg {item!r} must be key=value with a Python identifier as key")
        try:
            args[key] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            args[key] = text
    return args


_register_run()


PLAN_FLAGS = {"config", "resume", "workers", "strategy", "transport", "schedule", "run_dir"}  # plan's own, or moot
PLAN_TRAFFIC_FLAGS = ("compress", "comm_delay_ms", "comm_bandwidth")  # what every strategy's traffic goes through


def _plan_parameters() -> list[inspect.Parameter]:
    """`plan` takes the run flags that describe the task and its training (model, data, batch, optimizer,
    ...), and its own: the worker counts to compare and the machine to plan for."""
    keyword = inspect.Parameter.KEYWORD_ONLY

    def own(name: str, kind: Any, help: str, default: Any = None) -> inspect.Parameter:
        flag = "--" + name.replace("_", "-").removesuffix("-dir")
        option = typer.Option(flag, help=help, show_default=default is not None, rich_help_panel="plan")
        return inspect.Parameter(name, keyword, default=default, annotation=Annotated[kind, option])

    return [
        own("workers", str, "Worker counts to compare, a comma list, e.g. 1,2,4,64,1024.", "1,2,4"),
        own("out_dir", Path | None, "Directory for plan.json, predictions.parquet, plan.png; must be new or empty."),
        own("preset", str | None, "What-if hardware by name: " + ", ".join(_preset_names()) + "."),
        own("bandwidth", str | None, "What-if link rate, e.g. 25gbit (same units as --comm-bandwidth)."),
        own("latency", str | None, "What-if link latency, e.g. 5us or 0.2ms."),
        own("gpu_flops", str | None, "What-if achieved FLOP/s per worker, e.g. 300tflops (built-in models)."),
        own("calibration", Path | None, "Reuse the calibration of an earlier plan (its directory or plan.json)."),
        own("calibration_steps", int, "Steps of each tiny calibration run (as long as the runs you plan is best).", 40),
        own("calibration_repeats", int, "Repeats of each tiny run (medians); 1 is faster, less robust to load.", 3),
        inspect.Parameter(
            "config",
            keyword,
            default=None,
            annotation=Annotated[Path | None, typer.Option("--config", help="YAML file of run config keys.")],
        ),  # fmt: skip
        *(
            _field_parameter(RunConfig.field_info(name))
            for name in RunConfig.field_names()
            if name not in PLAN_FLAGS
            and (RunConfig.field_info(name).section not in ("strategy",) or name in PLAN_TRAFFIC_FLAGS)
        ),
    ]


def _preset_names() -> list[str]:
    from distrain.orchestrator.planner import PRESETS  # pure arithmetic: no torch, no Ray

    return list(PRESETS)


def _register_plan() -> None:
    def plan(**flags: Any) -> None:
        """Predict step time, traffic and memory of every strategy at each worker count, calibrated on this
        cluster with a few real steps and micro-benchmarks; recommend one, with its reason."""
        _plan(**flags)

    params = _plan_parameters()
    plan.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    plan.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    app.command("plan", cls=SectionedCommand)(user_errors(plan))


def what_if_hardware(preset: str | None, bandwidth: str | None, latency: str | None, gpu_flops: str | None) -> Any:
    """The machine --preset / --bandwidth / --latency / --gpu-flops describe (flags override the preset's
    figures), or None: plan for this cluster only."""
    from distrain.orchestrator.planner import PRESETS, Hardware
    from distrain.units import parse_duration, parse_flops, parse_rate

    if preset is None and bandwidth is None and latency is None and gpu_flops is None:
        return None
    if preset is not None and preset not in PRESETS:
        raise DistrainError(f"--preset {preset!r} is not known; choose one of: {', '.join(PRESETS)}")
    base = PRESETS[preset] if preset else None
    if base is None and bandwidth is None:
        raise DistrainError("--latency and --gpu-flops need --bandwidth (or a --preset) to describe the link")
    return Hardware(
        name=preset or f"{bandwidth}",
        bandwidth=parse_rate(bandwidth, "--bandwidth") if bandwidth else base.bandwidth,
        latency_s=parse_duration(latency, "--latency") if latency else (base.latency_s if base else 10e-6),
        flops=parse_flops(gpu_flops) if gpu_flops else (base.flops if base else None),
        source=(base.source if base else "given on the command line")
        + ("" if latency or base else "; latency 10 us assumed (pass --latency)"),
    )


def _plan(
    workers: str,
    out_dir: Path | None,
    preset: str | None,
    bandwidth: str | None,
    latency: str | None,
    gpu_flops: str | None,
    calibration: Path | None,
    calibration_steps: int,
    calibration_repeats: int,
    config: Path | None,
    task_arg: list[str] | None = None,
    optimizer_arg: list[str] | None = None,
    **flags: Any,
) -> None:
    from distrain.units import parse_worker_counts

    counts = parse_worker_counts(workers)
    hardware = what_if_hardware(preset, bandwidth, latency, gpu_flops)
    if calibration_steps < 6:
        raise DistrainError(
            f"--calibration-steps must be at least 6 (a warm-up and a steady state), got {calibration_steps}"
        )
    if calibration_repeats < 1:
        raise DistrainError(f"--calibration-repeats must be at least 1, got {calibration_repeats}")
    overrides = dict(flags, workers=1, strategy="bsp", transport="", schedule="")
    overrides["task_args"] = parse_task_args(task_arg) if task_arg else None
    overrides["optimizer_args"] = parse_optimizer_args(optimizer_arg) if optimizer_arg else None
    cfg = RunConfig.resolve(str(config) if config else None, overrides)
    from distrain.orchestrator.plan_run import choose_out_dir, load_calibration, make_plan

    saved = load_calibration(calibration) if calibration else None
    target = choose_out_dir(out_dir)
    if saved is None:
        what = f"{calibration_repeats} x 4 tiny runs of {calibration_steps} steps, two probes"
        out.print(f"calibrating on this cluster ({what})...", markup=False, highlight=False)
    result = make_plan(cfg, counts, target, hardware, saved, steps=calibration_steps, repeats=calibration_repeats)
    print_plan(result)


def _print_wide(table: Table) -> None:
    """Logs, pipes: nothing wraps the lines, so print the table at its natural width."""
    console = out
    if not out.is_terminal:
        natural = out.measure(table, options=out.options.update_width(1_000)).maximum
        console = Console(file=out.file, width=max(out.width, natural), soft_wrap=True)
    console.print(table)


def print_plan(result: Any) -> None:
    cal = result.calibration
    out.print(
        f"calibration: {cal.task}, batch {cal.batch_size}, {cal.num_params:,} parameters; compute "
        f"{cal.compute_s * 1e3:.1f} ms/step alone; a second worker stretches a step "
        f"x{1 + cal.contention_slope:.2f}; all-reduce "
        f"{cal.allreduce_latency_s * 1e6:.0f} us + {cal.allreduce_bandwidth / 1e6:.0f} MB/s; PS round trip "
        f"{cal.ps_call_s * 1e3:.1f} ms"
        + (f"; --compress {cal.codec}" if cal.codec else "")
        + (
            f"; planned for the emulated link: {cal.link_latency_s * 1e3:g} ms per transfer"
            + (f" + {cal.link_bandwidth / 1e6:g} MB/s" if cal.link_bandwidth else "")
            if cal.link_emulated
            else ""
        ),
        markup=False,
        highlight=False,
    )
    machines = [("this cluster", result.here)]
    if result.hardware is not None:
        machines.append((f"{result.hardware.name} ({result.hardware.source})", result.whatif))
    for title, rows in machines:
        table = Table(title=Text(f"predicted per worker step: {title}"))
        for i, name in enumerate(("N", "strategy", "transport", "step ms", "compute", "comm", "overlap", "wait",
                                  "samples/s", "KB/worker/step", "MiB/worker", "fan-in")):  # fmt: skip
            table.add_column(name, justify="left" if 0 < i < 3 else "right")
        for p in rows:
            table.add_row(
                str(p.workers), p.strategy + (f" {p.setting}" if p.setting else ""), p.transport,
                f"{p.step_s * 1e3:.1f}", f"{p.compute_s * 1e3:.1f}", f"{p.comm_s * 1e3:.1f}",
                f"{p.overlap_s * 1e3:.1f}", f"{p.wait_s * 1e3:.1f}", f"{p.samples_per_s:,.0f}",
                f"{p.bytes_per_worker / 1e3:,.1f}", f"{p.memory_per_worker / 2**20:,.0f}", str(p.fan_in),
            )  # fmt: skip
        _print_wide(table)
    for n, costs in result.stragglers.items():
        if n > 1:
            parts = ", ".join(f"{k} x{v:.2f}" for k, v in costs.items())
            out.print(f"stragglers at N={n} (expected round time / median step): {parts}", markup=False,
                      highlight=False)  # fmt: skip
    n = max(result.recommendations)
    rec = result.recommendations[n]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in rec.settings.items())
    out.print(f"recommended at N={n}: --strategy {rec.strategy} --transport {rec.transport} {flags}".rstrip()
              + f": {rec.reason}", markup=False, highlight=False)  # fmt: skip
    out.print(f"plan in {result.out}/ (plan.json, predictions.parquet, plan.png)", markup=False, highlight=False)


_register_plan()


@app.command("strategies")
def list_strategies() -> None:
    """List the built-in strategies: what each does, the transports it runs on (its default first) and
    its own options. Your own: --strategy path/to/file.py:ClassName (a distrain.strategies.base.Strategy)."""
    from distrain.fields import fields_of
    from distrain.strategies import STRATEGIES

    for name, text in STRATEGIES.describe().items():
        cls = STRATEGIES.get(name)
        flags = " ".join(info.flag for info in fields_of(cls.Options))
        out.print(f"{name:<11} {text}", highlight=False)
        out.print(f"{'':<11}   transports: {', '.join(cls.transports)}" + (f"; options: {flags}" if flags else ""),
                  highlight=False)  # fmt: skip
        if cls.compresses:
            out.print(f"{'':<11}   --compress applies to: {cls.compresses}", highlight=False)


@app.command()
@user_errors
def report(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories written by `distrain run` (e.g. runs/*).", show_default=False)
    ],
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Directory for report.md and the plots; must be new or empty. Default: report-<timestamp>/ here.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Compare runs: one table (here and in report.md) and PNG plots of accuracy, loss, throughput, time split."""
    from distrain.orchestrator.report import (
        COLUMNS,
        choose_out_dir,
        distinct_dirs,
        load_runs,
        table_rows,
        write_report,
    )

    run_dirs, repeats = distinct_dirs(run_dirs)
    runs = load_runs(run_dirs)
    target = choose_out_dir(out_dir)
    written = write_report(runs, target)
    table = Table(title=Text(f"distrain report: {len(runs)} run(s)"))
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="left" if i < 2 else "right", no_wrap=i == 0)
    for row in table_rows(runs):
        table.add_row(*row)
    console = out
    if not out.is_terminal:  # logs, pipes: nothing wraps the lines, so print the table at its natural width
        natural = out.measure(table, options=out.options.update_width(1_000)).maximum
        console = Console(file=out.file, width=max(out.width, natural), soft_wrap=True)
    console.print(table)
    from distrain.orchestrator.report_prediction import COLUMNS as PREDICTED
    from distrain.orchestrator.report_prediction import prediction_rows

    predicted = prediction_rows(runs)
    if predicted:
        table = Table(title=Text("predicted against measured step time"))
        for i, name in enumerate(PREDICTED):
            table.add_column(name, justify="left" if i < 2 else "right")
        for row in predicted:
            table.add_row(*row)
        _print_wide(table)
    files = ", ".join(p.name for p in written)
    out.print(f"report in {target}/ ({files})", markup=False, highlight=False)
    for path, kept in repeats:  # said, not silently dropped
        note = f"note: {str(path)!r} is the same run directory as {str(kept)!r}; it is reported once"
        err.print(note, markup=False, highlight=False)


def _sweep_opt(help: str) -> Any:
    return typer.Option(help=help, show_default=False, rich_help_panel="sweep")


def _search_opt(help: str) -> Any:
    return typer.Option(help=help, rich_help_panel="search")


# Sweep flags: each names one RunConfig field and takes a list (a,b,c) or, for real values, a range
# (LOW:HIGH or LOW:HIGH:log, random search only).
SWEPT_FLAGS = {
    "batch_sizes": ("batch_size", "--batch-sizes"),
    "lr": ("lr", "--lr"),
    "lr_scaling": ("lr_scaling", "--lr-scaling"),
    "warmup_epochs": ("warmup_epochs", "--warmup-epochs"),
    "workers": ("workers", "--workers"),
    "strategies": ("strategy", "--strategies"),
    "staleness": ("staleness", "--staleness"),
}


# A sweep of more trials than this asks first (or takes --yes). A 4 x 4 x 2 grid (README's example is
# 24 trials) is deliberate and starts at once; what this catches is the accident: one more axis than
# meant, --num-samples 500, a list typed with an extra value, each worth hours of cluster time.
CONFIRM_ABOVE = 32


def _stdin_is_terminal() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def _confirm_large_sweep(header: str, num_trials: int) -> None:
    """Ask on a terminal. Without one (CI, cron, nohup) nobody can answer, so the sweep is refused rather
    than started: a script that means a large sweep says --yes."""
    if not _stdin_is_terminal():
        raise DistrainError(
            f"this sweep has {num_trials} trials (more than {CONFIRM_ABOVE}) and there is no terminal to confirm "
            "it on; add --yes to start it"
        )
    out.print(header, markup=False, highlight=False)
    try:
        start = typer.confirm(f"start {num_trials} trials?", default=False)
    except Abort:  # end of input
        start = False
    if not start:
        err.print("sweep not started; nothing written", markup=False, highlight=False)
        raise typer.Exit(1)


@app.command(cls=SectionedCommand)
@user_errors
def tune(
    config: Annotated[
        Path | None, typer.Option("--config", help="Base run config (YAML) every trial starts from.")
    ] = None,
    batch_sizes: Annotated[str | None, _sweep_opt("Per-worker batch sizes, e.g. 16,32,64,128.")] = None,
    lr: Annotated[str | None, _sweep_opt("Base learning rates: a list (0.01,0.1) or a range (0.01:0.5:log).")] = None,
    lr_scaling: Annotated[str | None, _sweep_opt("LR scaling rules vs --base-batch-size: linear,sqrt,none.")] = None,
    warmup_epochs: Annotated[str | None, _sweep_opt("Warmup epochs: a list (0,1) or a range (0:2).")] = None,
    workers: Annotated[str | None, _sweep_opt("Worker counts per trial, e.g. 2,4.")] = None,
    strategies: Annotated[str | None, _sweep_opt("Strategies, e.g. bsp,ssp.")] = None,
    staleness: Annotated[str | None, _sweep_opt("SSP staleness bounds, e.g. 0,2,8 (needs an ssp strategy).")] = None,
    param: Annotated[
        list[str] | None, _sweep_opt("NAME=VALUES for any other config field (repeatable), e.g. momentum=0.8,0.9.")
    ] = None,
    search: Annotated[str, _search_opt(help="grid (every combination) or random (--num-samples draws).")] = "grid",
    num_samples: Annotated[
        int, _search_opt(help="Random search: trials to draw; grid search: repeats of the grid.")
    ] = 1,
    scheduler: Annotated[str, _search_opt(help="none, or asha: stop trials whose accuracy lags at a rung.")] = "none",
    grace_period: Annotated[int, _search_opt(help="ASHA: epochs every trial runs before it can be stopped.")] = 1,
    max_concurrent_trials: Annotated[
        int, _search_opt(help="At most this many trials at once (0: as many as the cluster holds).")
    ] = 0,
    time_budget: Annotated[float, _search_opt(help="Stop the sweep after this many seconds (0: no limit).")] = 0.0,
    objective: Annotated[
        str,
        _search_opt(
            help="time_to_target (ascending; then the final metric) or final_metric: the final value of the target "
            "metric (--target, or the task's), best first (final_accuracy: the same, its older name)."
        ),
    ] = "time_to_target",
    epochs: Annotated[int | None, _opt("epochs")] = None,
    task: Annotated[str | None, _opt("task")] = None,
    task_arg: Annotated[list[str] | None, _opt("task_args", "--task-arg", metavar="KEY=VALUE")] = None,
    target: Annotated[str | None, _opt("target")] = None,
    model: Annotated[str | None, _opt("model")] = None,
    dataset: Annotated[str | None, _opt("dataset")] = None,
    data_dir: Annotated[str | None, _opt("data_dir")] = None,
    cpus_per_worker: Annotated[float | None, _opt("cpus_per_worker")] = None,
    base_batch_size: Annotated[int | None, _opt("base_batch_size")] = None,
    target_accuracy: Annotated[float | None, _opt("target_accuracy")] = None,
    seed: Annotated[int | None, _opt("seed")] = None,
    address: Annotated[str | None, _opt("address")] = None,
    cluster_cpus: Annotated[
        int, typer.Option(help="Local Ray only: logical CPUs (default: this machine's, at least one trial's).")
    ] = 0,
    sweep_dir: Annotated[
        str | None, typer.Option(help="Sweep directory (default sweep/<timestamp>-tune); must be new or empty.")
    ] = None,
    resume: Annotated[
        Path | None, typer.Option(help="Go on with an interrupted sweep directory (its own settings; no sweep flags).")
    ] = None,
    yes: Annotated[
        bool,
        typer.Option(
            "--yes",
            "-y",
            help=f"Start a sweep of more than {CONFIRM_ABOVE} trials without asking (needed without a terminal).",
            rich_help_panel="search",
        ),
    ] = False,
) -> None:
    """Sweep batch size, LR scaling, warmup, LR (and more) with Ray Tune; each trial is a distributed run."""
    from distrain.orchestrator.sweep_spec import (
        SweepSpec,
        parse_dimension,
        parse_param,
        plugin_strategies,
        sweep_base,
    )

    values = locals()
    dimensions: dict[str, Any] = {}
    for arg, (name, flag) in SWEPT_FLAGS.items():
        if values[arg] is not None:
            dimensions[name] = parse_dimension(name, values[arg], flag)
    if "strategy" in dimensions:  # strategies named by path: absolute (trials run elsewhere), and loaded, so
        dimensions["strategy"] = plugin_strategies(dimensions["strategy"])  # their options can be swept
    for spec_text in param or []:
        name, dim = parse_param(spec_text)
        if name in dimensions:
            raise DistrainError(f"--param {name} repeats a sweep flag; give {name} once")
        dimensions[name] = dim
    base_flags = dict(
        epochs=epochs,
        task=task,
        task_args=parse_task_args(task_arg) if task_arg else None,
        target=target,
        model=model,
        dataset=dataset,
        data_dir=data_dir,
        cpus_per_worker=cpus_per_worker,
        base_batch_size=base_batch_size,
        target_accuracy=target_accuracy,
        seed=seed,
        address=address,
    )
    if resume is not None:
        from distrain.orchestrator.tune import load_spec

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
        _confirm_large_sweep(header, spec.num_trials())
    else:
        out.print(header, markup=False, highlight=False)

    from distrain.orchestrator.tune import run_sweep  # Ray, Tune and torch load only from here on
    from distrain.sweep_display import SweepDisplay, print_table, results_table

    try:
        with SweepDisplay(out, spec.num_trials(), spec.time_budget_s) as display:
            sweep = run_sweep(spec, where, display.on_event, resume=resume is not None, cluster_cpus=cluster_cpus)
    except KeyboardInterrupt:  # a second Ctrl-C, or SIGTERM: the trials were killed with Ray
        err.print(_sweep_interrupted_line(Path(where).absolute(), None), markup=False, highlight=False)
        raise typer.Exit(interrupts.exit_code()) from None
    if sweep.interrupted:  # Ctrl-C: Tune stopped the trials and saved its state
        err.print(_sweep_interrupted_line(sweep.sweep_dir, sweep.results), markup=False, highlight=False)
        raise typer.Exit(interrupts.exit_code())
    title = f"distrain tune: {len(sweep.results)} trial(s), best first by {spec.objective}"
    width = out.width if out.is_terminal else None  # a log gets the table at its natural width
    print_table(out, results_table(sweep.results, list(spec.dimensions), title, width=width))
    out.print(f"sweep took {sweep.wall_time_s:.1f} s", markup=False, highlight=False)
    unfinished = sweep.results["status"].isin(["stopped", "pending"]).sum() if len(sweep.results) else 0
    if unfinished and (spec.scheduler == "none" or (sweep.results["status"] == "pending").any()):
        out.print(
            f"{unfinished} trial(s) did not finish; go on with: distrain tune --resume {sweep.sweep_dir}",
            markup=False,
            highlight=False,
        )
    out.print(f"results in {sweep.sweep_dir}/ (results.parquet, results.csv, trials/)", markup=False, highlight=False)
    failed = sweep.results[sweep.results["status"] == "error"] if len(sweep.results) else sweep.results
    for _, row in failed.iterrows():
        err.print(f"trial {row['trial_id']} failed: {row['error']}", markup=False, highlight=False)
    if sweep.best is None:
        err.print("no trial ran to a result; nothing to recommend", markup=False, highlight=False)
        raise typer.Exit(1)
    out.print(
        f"best config: {sweep.sweep_dir}/best.yaml  (repeat it: distrain run --config {sweep.sweep_dir}/best.yaml)",
        markup=False,
        highlight=False,
    )


def _sweep_interrupted_line(sweep_dir: Path, results: Any) -> str:
    what = f"interrupted ({interrupts.name()})"
    if not (sweep_dir / "sweep.json").is_file() or not (sweep_dir / "tune").is_dir():
        return f"{what} before the sweep started: nothing to go on with"
    done = ""
    if results is not None:
        finished = int((results["status"] == "completed").sum()) if len(results) else 0
        done = f" {finished} trial(s) finished, results so far in {sweep_dir}/;"
    return f"{what}:{done} go on with: distrain tune --resume {sweep_dir}"


class RunDisplay:
    """What `distrain run` shows while it runs.

    On a terminal: at once, a line saying what the run is doing while it prepares (checking the
    settings, loading Ray and torch, the run's checks, Ray's start, placing and starting the workers),
    which goes when training starts or an error is shown; then a live bar (epoch, step, the run's
    elapsed time and the time left; under it loss, samples/s, the last test figures) with a line per
    finished epoch kept above it. Otherwise (logs, CI, pipes, `ray job submit`): the same line per
    finished epoch, and a `still ...` line whenever nothing was printed for DISTRAIN_PROGRESS_EVERY_S
    seconds (run_progress.py), so neither a long start nor a long epoch is silent.

    Both show the summary's steady-state samples/s (orchestrator/throughput.py) over the rows so far,
    and the elapsed time as the summary counts it: from the run's start (a resumed run's goes on).
    """

    def __init__(
        self,
        cfg: RunConfig | None = None,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
        every_s: float | None = None,
        run_dir: str = "",
    ) -> None:
        """`cfg` may come later (`configured`): the display starts before the settings are checked,
        which loads torch; `run_dir` is the one asked for, if any, until then."""
        self.cfg: Any = None
        self.console = console or out
        self.live = self.console.is_terminal
        self.clock = clock
        self.every_s = heartbeat_seconds() if every_s is None else every_s
        self.run_clock = RunClock(clock)
        one_line = Column(no_wrap=True)  # the bar narrows (down to nothing) before a figure wraps
        self.progress = _TwoLineProgress(
            TextColumn("[bold]epoch {task.fields[epoch]}", table_column=one_line),
            BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=0)),
            TextColumn("step {task.completed:.0f}/{task.total:.0f}", table_column=one_line),
            _RunTimeColumn(self.run_clock, table_column=one_line),
            console=self.console,
            disable=not self.live,
            expand=True,
            transient=True,  # at the end only the epoch lines stay, above the summary
        )
        self.task: Any = None
        self.started: Any = None  # the RunStarted event
        self.latest: Any = None  # the last Progress event
        self.next_line = 0  # the epoch whose line is printed next
        self.evaluations: dict[int, Any] = {}  # epoch -> its evaluation's Progress event, until printed
        self.where = f"run {run_dir}" if run_dir else "the run"
        self.stage = "checking the settings"
        if cfg is not None:
            self.configured(cfg)
        self.since = clock()  # preparing since
        self.preparing: Live | None = None  # the terminal's line while the run prepares
        self.spinner = Spinner("dots")
        self.lock = threading.Lock()  # the heartbeat's thread and the events' take turns
        self.last_said = self.since
        self.heartbeat = Heartbeat(self.tick)

    def __enter__(self) -> RunDisplay:
        if self.live:
            self.preparing = Live(
                get_renderable=self._preparing_line, console=self.console, transient=True, refresh_per_second=4
            )
            self.preparing.start(refresh=True)  # at once, not at the first auto refresh
        elif self.every_s:
            self.heartbeat.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.heartbeat.stop()
        self._prepared()
        self.progress.__exit__(*exc)

    def configured(self, cfg: RunConfig) -> RunConfig:
        """The run's settings, checked; returns them."""
        self.cfg = cfg
        self.where = f"run {cfg.run_dir}" if cfg.run_dir else self.where
        self.stage = "loading Ray and torch"
        return cfg

    def _prepared(self) -> None:
        if self.preparing is not None:
            self.preparing.stop()
            self.preparing = None

    def _preparing_line(self) -> Any:
        line = Table.grid(padding=(0, 1))
        line.add_row(
            self.spinner, Text(f"preparing {self.where}: {self.stage}  {clock_text(self.clock() - self.since)}")
        )
        return line

    def say(self, text: str) -> None:
        """A line of the command's own (e.g. --strategy auto's choice), above the preparing line."""
        with self.lock:
            self._say(text)

    def _say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)
        self.last_said = self.clock()

    def tick(self) -> None:
        """Not a terminal: a `still ...` line when nothing was said for `every_s` (the heartbeat's thread)."""
        with self.lock:
            if self.every_s and self.clock() - self.last_said >= self.every_s:
                self._say(self._still_line())

    def _still_line(self) -> str:
        if self.started is None:
            return f"still preparing {self.where}: {self.stage} ({clock_text(self.clock() - self.since)} so far)"
        event, total = self.latest, self.started.total_steps
        if event is None:
            where = f"step {self.started.start_step}/{total}"
        else:
            where = (
                f"epoch {event.epoch + 1}/{event.epochs}  step {event.steps_done}/{total}  loss {event.loss:.4f}"
                f"  {_speed(event.samples_per_s)} samples/s"
            )
        return f"still training: {where}  {_run_times(self.run_clock.elapsed(), self.run_clock.left())}"

    def on_event(self, event: Any) -> None:
        interrupts.check()  # a signal whose first raise some library code swallowed still ends the run
        with self.lock:
            self._on_event(event)

    def _on_event(self, event: Any) -> None:
        from distrain.orchestrator.membership import MembershipChanged
        from distrain.orchestrator.recovery import Failure
        from distrain.orchestrator.run import Notice, Preparing, RunStarted, StragglersChanged, WorkersStarting
        from distrain.orchestrator.run import Progress as RunProgress

        if isinstance(event, Preparing):
            self.stage = event.stage
            if event.run_dir is not None:
                self.where = f"run {event.run_dir}"
            return
        if isinstance(event, Notice):
            self._say(f"note: {event.text}")
            return
        if isinstance(event, WorkersStarting):
            self.stage = f"starting workers {event.started}/{event.total}"
            if not self.live:
                self._say(self.stage)
            return
        if isinstance(event, MembershipChanged):
            self._say(membership_line(event, self.cfg.worker_range))
            return
        if isinstance(event, StragglersChanged):
            slow = ", ".join(f"worker {w} ({r:.1f}x the others' step time)" for w, r in sorted(event.slow.items()))
            self._say(f"step {event.step}: stragglers: {slow or 'none now'}")
            return

        if isinstance(event, Failure):
            bound = "no limit" if event.max_failures == -1 else f"of at most {event.max_failures}"
            self._say(f"failure {event.number} ({bound}): {event.what} at step {event.at_step}; {event.then}")
            if self.started is not None and not event.replaced:  # epochs after the checkpoint are redone
                self.next_line = min(self.next_line, event.restored_step // self.started.steps_per_epoch)
        elif isinstance(event, RunStarted):
            self._prepared()
            self._say(
                f"run dir {event.run_dir}  |  {_short(self.cfg.strategy)} x {self.cfg.to_dict()['workers']} workers on "
                f"{event.nodes} node(s)  |  {describe_task(self.cfg)} ({event.num_params:,} params)"
                f"  |  {event.total_steps} steps"
            )
            self.started = event
            self.next_line = event.start_step // event.steps_per_epoch
            self.run_clock.started(event.elapsed_s)
            if self.task is None:  # a resumed run's next attempt starts again: the same bar
                self.task = self.progress.add_task(
                    "train", total=event.total_steps, completed=event.start_step, epoch="-", loss="-", speed="-", acc=""
                )
                self.progress.start()
        elif isinstance(event, RunProgress):
            self.latest = event
            self.run_clock.progress(event.elapsed_s, event.steps_done, event.total_steps)
            fields: dict[str, Any] = {
                "epoch": f"{event.epoch + 1}/{event.epochs}",
                "loss": f"{event.loss:.4f}",
                "speed": _speed(event.samples_per_s),
                "acc": test_figures(event),
            }
            if self.task is not None:
                self.progress.update(self.task, completed=event.steps_done, **fields)
            if self.started is not None:
                self._epoch_lines(event)

    def _epoch_lines(self, event: Any) -> None:
        """Print each finished epoch's line, in order (on a terminal above the bar, which keeps them): an
        epoch that is evaluated once its evaluation is in (with the test accuracy), any other once its
        last step is done (so --eval-every 0 still shows)."""
        from distrain.orchestrator.run import evaluates

        spe, total = self.started.steps_per_epoch, self.started.total_steps
        last_epoch = (total - 1) // spe
        if event.evaluated:
            self.evaluations[event.epoch] = event
        while self.next_line <= last_epoch:
            epoch = self.next_line
            end = min((epoch + 1) * spe, total)
            evaluated = evaluates(epoch, last_epoch, self.cfg.eval_every)
            if evaluated:
                shown = self.evaluations.pop(epoch, None)
                if shown is None:
                    return
            elif event.steps_done >= end:
                shown = event
            else:
                return
            acc = f"  {test_figures(shown)}" if evaluated else ""
            left = self.run_clock.left_at(shown.elapsed_s, end, total) if end < total else None
            self._say(
                f"epoch {epoch + 1}/{shown.epochs}  step {end}/{total}  loss {shown.loss:.4f}{acc}"
                f"  {_speed(shown.samples_per_s)} samples/s  {_run_times(shown.elapsed_s, left)}"
            )
            self.next_line += 1


class _TwoLineProgress(Progress):
    """The bar with the run's position and times, and under it the figures (loss, samples/s, the last
    evaluation): one line of all of it would be cut short on an 80-column terminal."""

    def get_renderables(self) -> Any:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            figures = f"loss {task.fields['loss']}  {task.fields['speed']} samples/s  {task.fields['acc']}"
            yield Text(figures.rstrip(), no_wrap=True, overflow="ellipsis")


class _RunTimeColumn(ProgressColumn):
    """The bar's elapsed run time (from the run's start, as the epoch lines and the summary count it,
    not from the bar's) and the time left."""

    def __init__(self, run_clock: RunClock, table_column: Column | None = None) -> None:
        super().__init__(table_column)
        self.run_clock = run_clock

    def render(self, task: Any) -> Text:
        return Text(_run_times(self.run_clock.elapsed(), self.run_clock.left()))


def _run_times(elapsed_s: float, left_s: float | None) -> str:
    return f"elapsed {clock_text(elapsed_s)}" + ("" if left_s is None else f"  eta {clock_text(left_s)}")


def test_figures(event: Any) -> str:
    """The last evaluation, shortly: test accuracy for classification, else every figure the task reports."""
    metrics = event.test_metrics or ({} if event.test_accuracy is None else {"accuracy": event.test_accuracy})
    if "accuracy" in metrics:
        return f"test acc {metrics['accuracy']:.4f}"
    return "  ".join(f"test {name} {value:.4g}" for name, value in metrics.items())


def _speed(samples_per_s: float | None) -> str:
    return "-" if samples_per_s is None else f"{samples_per_s:,.0f}"


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def membership_line(event: Any, worker_range: tuple[int, int]) -> str:
    """One line per join or leave of an elastic run: who, why, how many now, what is redone."""
    low, high = worker_range
    verb = "joined" if event.change == "join" else "left"
    redone = f"; its {event.units_redone} unit(s) go to the others" if event.units_redone else ""
    return f"step {event.step}: worker {event.rank} {verb} ({event.cause}){redone}; {event.members} of {low}..{high}"


def membership_row(summary: dict[str, Any]) -> tuple[str, str] | None:
    """The summary's line for an elastic run's membership over time."""
    m = summary.get("membership")
    if not m:
        return None
    return (
        "workers peak / final / joins / leaves",
        f"{m['peak_members']} / {m['final_members']} / {m['joins']} / {m['leaves']} "
        f"({m['samples_redone']:,} samples redone, {m['reform_s']:.1f} s setting up joiners)",
    )


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    table = Table(title=Text(f"distrain run {summary['run_id']}"), show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [] if summary.get("status") == "completed" else [("status", str(summary.get("status")))]
    rows += [
        ("strategy", f"{_short(summary['strategy'])} x {summary['workers']} workers"),
        (
            ("model / data", f"{summary['model']} / {summary['dataset']}")
            if summary.get("task") in (None, "classification")
            else ("task", str(summary["task"]))
        ),
        ("epochs / steps", f"{summary['epochs_completed']} / {summary['steps_completed']}"),
        *[
            (f"final {key.removeprefix('final_').replace('_', ' ')}", _fmt(value, ".4f"))
            for key, value in summary.items()
            if key.startswith("final_test_")
        ],
        *_target_rows(summary),
        ("wall time", _fmt(summary["wall_time_s"], ".1f") + " s"),
        ("steady-state throughput", _fmt(summary["steady_state_samples_per_s"], ",.0f") + " samples/s"),
        ("sent per step (all workers)", _size(summary["bytes_per_step"])),
        (
            "mean compute / comm per step",
            f"{_fmt(summary['mean_compute_s'], '.4f')} / {_fmt(summary['mean_comm_s'], '.4f')} s",
        ),
    ]
    if summary.get("staleness_p95") is not None:
        rows += [
            (
                "staleness p50 / p95 / max",
                f"{summary['staleness_p50']:g} / {summary['staleness_p95']:g} / {summary['staleness_max']}",
            ),
            ("time blocked (all workers)", _fmt(summary["wait_s_total"], ".2f") + " s"),
            (
                "pushed / pulled per step",
                f"{_size(summary['bytes_pushed_per_step'])} / {_size(summary['bytes_pulled_per_step'])}",
            ),
        ]
    if summary.get("staleness_lr") is not None:  # async, ssp: what their shards applied
        rows.append(("staleness-aware rate (lr / staleness)", "on" if summary["staleness_lr"] else "off"))
    rows += _straggler_rows(summary)
    elastic = membership_row(summary)
    if elastic is not None:
        rows.append(elastic)
    if summary.get("failures"):
        rows.append(
            (
                "failures survived / time lost / steps redone",
                f"{summary['failures']} / {_fmt(summary['time_lost_s'], '.1f')} s / {summary['updates_lost']}",
            )
        )
    if summary.get("nonfinite_steps"):
        rows.append(("steps with a non-finite loss or gradient", str(summary["nonfinite_steps"])))
    if summary.get("overflow_steps"):
        rows.append(("of which fp16 overflows (skipped, normal)", str(summary["overflow_steps"])))
    if summary.get("chaos"):  # --chaos: each event and the step it struck at
        fired = [f"{c['event']} at {c['fired_step']}" for c in summary["chaos"] if c["fired"]]
        rows.append(("faults injected (step)", ", ".join(fired) or "none"))
    if summary.get("averaging_rounds") is not None:
        rows += [
            ("averaging rounds", str(summary["averaging_rounds"])),
            ("communicated (all workers)", _size(summary["bytes_communicated"])),
            ("tau min / max / final", f"{summary['tau_min']} / {summary['tau_max']} / {summary['tau_final']}"),
        ]
    if summary.get("phases"):
        rows.append(("schedule", ", ".join(f"{p['strategy']} from step {p['start_step']}" for p in summary["phases"])))
    for key, value in rows:
        table.add_row(key, value)
    out.print(table)
    for c in summary.get("chaos") or []:
        if not c["fired"]:
            out.print(f"--chaos {c['event']} did not fire: {c['reason']}", markup=False, highlight=False)
    for line in summary.get("warnings") or []:
        out.print(f"warning: {line}", markup=False, highlight=False)
    out.print(f"results in {run_dir}/ ({', '.join(_run_files(run_dir))})", markup=False, highlight=False)
    _print_tensorboard_line(run_dir)  # last: where --tensorboard wrote the run's events


def _run_files(run_dir: Path) -> list[str]:
    """What the closing line names: the run's files that exist (a diverged or early-stopped run may have
    no checkpoints/, a run that failed before its first evaluation no metrics.parquet)."""
    names = ("config.yaml", "metrics.parquet", "summary.json", "checkpoints/")
    return [name for name in names if (run_dir / name.rstrip("/")).exists()]


def tensorboard_line(run_dir: Path) -> str | None:
    """With --tensorboard DIR (as the run's config.yaml records it): where the run's event files are
    (DIR/<run id>/, as orchestrator/tensorboard.py writes them) and the command that shows them."""
    import importlib.util
    import shlex

    try:
        root = str(RunConfig.load_yaml(run_dir / "config.yaml").get("tensorboard") or "")
    except (OSError, DistrainError):
        return None
    if not root:
        return None
    line = f"TensorBoard events in {Path(root) / run_dir.name}/; view with: tensorboard --logdir {shlex.quote(root)}"
    if importlib.util.find_spec("tensorboard") is None:  # distrain writes them without it (tensorboardX)
        line += " (the viewer: pip install tensorboard, or the tensorboard extra)"
    return line


def _print_tensorboard_line(run_dir: Path) -> None:
    line = tensorboard_line(run_dir)
    if line is not None:
        out.print(line, markup=False, highlight=False)


def _target_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Time to the run's target, or "not reached"; no row for a run without a target."""
    if "target" not in summary:
        return []
    seconds = summary.get("time_to_target_s")
    return [(f"time to {summary['target']}", "not reached" if seconds is None else f"{seconds:.1f} s")]


def _size(nbytes: float | None) -> str:
    """Bytes in human units ("680.0 kB"); summary.json keeps the raw count."""
    return "-" if nbytes is None else size_text(nbytes)


def _straggler_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if summary.get("stragglers"):
        flagged = ", ".join(
            f"{w} (step {d['first_detected_step']}{', to the end' if d['flagged_at_end'] else ''})"
            for w, d in summary["stragglers"].items()
        )
        rows.append(("stragglers detected (worker)", flagged))
    if summary.get("dropped_gradients") is not None:
        dropped = summary["dropped_gradients"]
        per_worker = " ".join(f"{w}:{n}" for w, n in dropped.items())
        rows.append(("gradients dropped as late/duplicate", f"{sum(dropped.values())} ({per_worker})"))
    if summary.get("backup_copies_issued") is not None:
        rows.append(
            (
                "portions re-executed (copies)",
                f"{summary['backup_copies_issued']} of {summary['backup_portions_issued']} handed out",
            )
        )
    return rows


def prepare_commands(argv: list[str]) -> None:
    """Build the commands for these arguments: a `--strategy my.py:Name` (on the command line, or in the
    --config file) is imported before the command line is parsed, so its own options are flags, in
    --help too, and are checked like the others. With --help, a `--task`'s constructor arguments are
    listed under --task-arg."""
    strategy = task = None
    if argv and argv[0] == "run":
        strategy, task = _flag_value(argv, "--strategy"), _flag_value(argv, "--task")
        config = _flag_value(argv, "--config")
        if (strategy is None or task is None) and config:
            recorded = RunConfig.load_yaml(config)
            strategy, task = strategy or recorded.get("strategy"), task or recorded.get("task")
    wanted = {"strategy": str(strategy)} if strategy and ":" in str(strategy) else {}
    if task and ":" in str(task) and ("--help" in argv or "-h" in argv):
        wanted["task"] = str(task)
    if wanted != _PLUGIN_VALUES:
        _PLUGIN_VALUES.clear()
        _PLUGIN_VALUES.update(wanted)
        _register_run()


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def main() -> int:
    """Console entry point: like `app()`, but a usage error (e.g. `--workers abc`) is one line too, and
    SIGTERM interrupts a run as Ctrl-C does (the only place that installs signal handlers)."""
    from distrain.orchestrator.remote_errors import plain_ray_logs_when_piped

    plain_ray_logs_when_piped()  # output to a file or a pipe (a log, `ray job submit`): no colour codes in it
    with interrupts.installed():
        return _main()


def _main() -> int:
    try:
        prepare_commands(sys.argv[1:])
    except DistrainError as e:
        err.print(Text("error: ", style="bold red") + Text(str(e)), highlight=False)
        return 2
    command = typer.main.get_command(app)
    try:
        return command.main(standalone_mode=False) or 0
    except click_exceptions.NoArgsIsHelpError as e:
        e.show()  # bare `distrain`: the help text
        return 0
    except click_exceptions.ClickException as e:
        err.print(Text("error: ", style="bold red") + Text(e.format_message()), highlight=False)
        return e.exit_code
    except (Abort, KeyboardInterrupt):  # a signal outside a command's own handling (click makes it Abort)
        err.print(f"interrupted ({interrupts.name()})", markup=False, highlight=False)
        return interrupts.exit_code()


if __name__ == "__main__":
    sys.exit(main())
