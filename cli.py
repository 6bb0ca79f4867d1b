"""The `distrain` command line: the typer app, its commands, and the console entry point (`main`).

Each command is declared here and its body lives in `commands/` (one module per command, plus the run's
display and closing table). `run`, `plan` and `tune` take the run options generated from the config's
field declarations (`commands/options.py`), each naming only its own options and which run options it
takes. Every user-facing problem (`DistrainError`) becomes one line on stderr and its exit code
(`EXIT_CODES`: 2 for bad input). This module knows neither Ray nor torch: the orchestrator is imported
only when a command needs it. `run`, `plan` and `tune` are stand-ins bearing their help texts until a
command line names one of them (`prepare_commands`) or `app` is read (`build_commands`): their options
come from every config field and strategy, which `distrain --help` need not load to list them.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.text import Text

from distrain.commands import console as consoles
from distrain.commands.help_texts import EXIT_CODES, PLAN_HELP, RUN_HELP, TUNE_HELP  # noqa: F401 (docs/flags.md)
from distrain.errors import DistrainError
from distrain.orchestrator import interrupts, ray_start

try:  # typer >= 0.24 parses with its own vendored copy of click (and keeps Abort in typer.exceptions)
    from typer._click import exceptions as click_exceptions
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover - older typer on the real click
    from click import exceptions as click_exceptions  # type: ignore[no-redef]
    from click.exceptions import Abort  # type: ignore[no-redef,assignment]

_app = typer.Typer(  # `app` (module __getattr__): with every command built
    name="distrain",
    help="Distributed SGD on Ray: BSP, async and SSP parameter servers, local SGD, one flag apart.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn a DistrainError into one line and its exit code (2 for bad input, 4 for a run that failed);
    Ctrl-C or SIGTERM into one line and exit code 130 or 143 (orchestrator/interrupts.py)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DistrainError as e:
            consoles.err.print(Text("error: ", style="bold red") + Text(str(e)), highlight=False)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:
            consoles.warn(_interrupted_line(getattr(e, "run_dir", None)))
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


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("distrain")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        from distrain import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        consoles.say(f"distrain {_version()}")
        raise typer.Exit()


@_app.callback()
def _app_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_print_version, is_eager=True, show_default=False
        ),
    ] = False,
) -> None:
    """Distributed SGD on Ray: BSP, async and SSP parameter servers, local SGD, one flag apart."""


# A strategy named by import path on the command line (`main` looks before parsing): its options become flags.
_PLUGIN_VALUES: dict[str, Any] = {}
_LATER = ("run", "plan", "tune")  # built from the config's fields only when needed (`build_commands`)
_built = False


def _register(name: str, function: Any, **options: Any) -> None:
    """Register `function` as the command `name`, in the place of the command of that name (the
    stand-in's, an earlier build's): the order of `distrain --help` stays the order below."""
    before = list(_app.registered_commands)
    _app.command(name, **options)(function)
    new = _app.registered_commands.pop()
    at = next((i for i, c in enumerate(before) if c.name == name), len(before))
    _app.registered_commands[:] = [*before[:at], new, *(c for c in before[at:] if c.name != name)]


def _stand_in(name: str, help_text: str) -> None:
    """The command `name` as `distrain --help` lists it: its help text, no options yet."""

    def command() -> None:  # pragma: no cover - replaced before any command line that names it is parsed
        raise AssertionError(f"{name} was not built")

    command.__name__ = name
    _register(name, command, help=help_text)


def _register_run() -> None:
    """(Re)build the `run` command from the config's fields: every section's, every built-in strategy's
    options, and the options of a strategy named by import path on the command line (`main`)."""
    from distrain.commands import run as run_command
    from distrain.commands.options import SectionedCommand, command_function

    run = command_function("run", run_command.run, run_command.parameters(_PLUGIN_VALUES), run_command.HELP)
    _register("run", user_errors(run), cls=SectionedCommand)


def build_commands() -> None:
    """Replace the stand-ins of run, plan and tune with the commands and all their options (once)."""
    global _built
    if _built:
        return
    from distrain.commands import plan as plan_command
    from distrain.commands import tune as tune_command
    from distrain.commands.options import SectionedCommand, command_function

    _register_run()
    plan = command_function("plan", plan_command.plan, plan_command.parameters(), plan_command.HELP)
    _register("plan", user_errors(plan), cls=SectionedCommand)
    tune = command_function("tune", _tune, tune_command.parameters(), tune_command.HELP)
    _register("tune", user_errors(tune), cls=SectionedCommand)
    _built = True


_stand_in("run", RUN_HELP)
_stand_in("plan", PLAN_HELP)


@_app.command("strategies")
def list_strategies() -> None:
    """List the built-in strategies: what each does, the transports it runs on (its default first) and
    its own options. Your own: --strategy path/to/file.py:ClassName (a distrain.strategies.base.Strategy)."""
    from distrain.commands.strategies import list_strategies

    list_strategies()


@_app.command()
@user_errors
def report(
    run_dirs: Annotated[
        list[str],  # not Paths: a --storage URI (s3://...) would lose a slash
        typer.Argument(
            help="Run directories written by `distrain run` (e.g. runs/*), or their --storage URIs.",
            show_default=False,
        ),
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
    from distrain.commands.report import report

    report(run_dirs, out_dir)


@_app.command()
@user_errors
def examples(
    copy: Annotated[
        Path | None,
        typer.Option(
            "--copy",
            metavar="DIR",
            help="Copy the examples into DIR (new or empty) to edit them; their commands then run from DIR.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """List the examples shipped with distrain (your own tasks, a strategy plugin, the notebook, the
    cluster configs), each with the command that runs it; --copy DIR copies them into DIR."""
    from distrain.commands import examples as bundled

    if copy is None:
        bundled.list_examples()
    else:
        bundled.copy_examples(copy)


def _stdin_is_terminal() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def _tune(**flags: Any) -> None:
    from distrain.commands import tune as tune_command

    # Whether a large sweep can be confirmed is asked at the time (a test stands in for the terminal).
    tune_command.tune(stdin_is_terminal=lambda: _stdin_is_terminal(), **flags)


_stand_in("tune", TUNE_HELP)

# Read here by tests and docs, loaded when read: (module, name).
_LAZY = {
    "_shown_default": ("distrain.commands.options", "shown_default"),
    "RunDisplay": ("distrain.commands.run_display", "RunDisplay"),
    "membership_line": ("distrain.commands.run_display", "membership_line"),
    "membership_row": ("distrain.commands.run_summary", "membership_row"),
    "print_summary": ("distrain.commands.run_summary", "print_summary"),
    "tensorboard_line": ("distrain.commands.run_summary", "tensorboard_line"),
}


def __getattr__(name: str) -> Any:
    """`app` with every command built; the names tests read here, loaded when read."""
    if name == "app":
        build_commands()
        return _app
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
            from distrain.config import RunConfig

            recorded = RunConfig.load_yaml(config)
            strategy, task = strategy or recorded.get("strategy"), task or recorded.get("task")
    wanted = {"strategy": str(strategy)} if strategy and ":" in str(strategy) else {}
    if task and ":" in str(task) and ("--help" in argv or "-h" in argv):
        wanted["task"] = str(task)
    if wanted != _PLUGIN_VALUES:
        _PLUGIN_VALUES.clear()
        _PLUGIN_VALUES.update(wanted)
        if _built:
            _register_run()
    if next((arg for arg in argv if not arg.startswith("-")), None) in _LATER:  # the command it names
        build_commands()


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
    with interrupts.installed(), ray_start.enabled():  # `distrain run` may begin its Ray while torch loads
        return _main()


def _main() -> int:
    try:
        prepare_commands(sys.argv[1:])
    except DistrainError as e:
        consoles.err.print(Text("error: ", style="bold red") + Text(str(e)), highlight=False)
        return 2
    command = typer.main.get_command(_app)
    try:
        return command.main(standalone_mode=False) or 0
    except click_exceptions.NoArgsIsHelpError as e:
        e.show()  # bare `distrain`: the help text
        return 0
    except click_exceptions.ClickException as e:
        consoles.err.print(Text("error: ", style="bold red") + Text(e.format_message()), highlight=False)
        return e.exit_code
    except (Abort, KeyboardInterrupt):  # a signal outside a command's own handling (click makes it Abort)
        consoles.warn(f"interrupted ({interrupts.name()})")
        return interrupts.exit_code()


if __name__ == "__main__":
    sys.exit(main())
