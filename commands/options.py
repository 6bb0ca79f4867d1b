"""The run options as typer parameters, made from the config's field declarations (fields.py `setting`:
flag, help text, section, metavar, shown default), so `run`, `plan` and `tune` share one definition:
each command declares only its own options plus which run options it takes (`run_options`).

A run option's parameter defaults to None (not given: the YAML file's value or the field's default
applies); its shown default goes at the end of its help text, and it sits in its section's help panel.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Iterable
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperCommand

from distrain.config import RunConfig
from distrain.errors import DistrainError
from distrain.fields import SECTIONS, FieldInfo

PY_TYPES: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str, "list[str]": list[str]}
KEYWORD = inspect.Parameter.KEYWORD_ONLY
# A repeatable field whose flag names one item (--worker-group for worker_groups): its parameter, named
# after the flag, is handed to the command under the field's own name (a KEY=VALUE mapping such as
# --task-arg is parsed by the command itself instead).
LISTED_UNDER_FLAG = {
    info.flag.removeprefix("--").replace("-", "_"): info.name
    for info in map(RunConfig.field_info, RunConfig.field_names())
    if info.kind == "list[str]" and info.flag.removeprefix("--").replace("-", "_") != info.name
}


def shown_default(field: str | FieldInfo) -> str | bool:
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


def field_option(field: str | FieldInfo, *decls: str, **kwargs: Any) -> Any:
    """A config field's flag, in its section's help panel, its default at the end of its help text (the
    text wraps with it, where typer's own default goes on a line of its own)."""
    info = RunConfig.field_info(field) if isinstance(field, str) else field
    shown = shown_default(info)
    text = info.help + (" " + escape(f"[default: {shown}]") if shown else "")
    return typer.Option(*decls, help=text, show_default=False, rich_help_panel=info.section, **kwargs)


def field_parameter(info: FieldInfo, plugin_values: dict[str, Any] | None = None) -> inspect.Parameter:
    """One config field as a flag: optional (None: not given), in its section's help panel. With a
    `--task` named by path in `plugin_values` (`--help`), --task-arg lists that task's arguments."""
    if info.name == "task_args" and plugin_values and "task" in plugin_values:
        from distrain.orchestrator.tasks import describe_task_args

        info = dataclasses.replace(info, help=f"{info.help} {describe_task_args(plugin_values['task'])}")
    kind = info.kind.removesuffix(" | None")
    py = list[str] if kind == "dict[str, Any]" else PY_TYPES[kind]  # KEY=VALUE, one per use
    if info.name == "workers":  # N or MIN..MAX: config.parse_workers reads both (as it does YAML's)
        py = str
    name = info.flag.removeprefix("--").replace("-", "_")
    decls = (info.flag,) if name != info.name else ()
    extra = {"metavar": info.metavar} if info.metavar else {}
    option = field_option(info, *decls, **extra)
    return inspect.Parameter(name, KEYWORD, default=None, annotation=Annotated[py | None, option])


def run_options(
    *,
    sections: Collection[str] = SECTIONS,
    also: Collection[str] = (),
    only: Iterable[str] | None = None,
    without: Collection[str] = (),
    plugin_values: dict[str, Any] | None = None,
) -> list[inspect.Parameter]:
    """The run options a command takes, as typer parameters, in the config's field order: those of the
    given `sections` (every section's, and every strategy's options, by default) and `also` named fields
    of other sections; or `only` the named ones, in that order; never those in `without` (the command's
    own, or moot for it).
    `plugin_values`: a strategy or task named by import path, whose options (arguments) are shown too."""
    names = RunConfig.field_names(plugin_values)
    if only is not None:  # in the order given
        names = [n for n in only if n in names]
    infos = [RunConfig.field_info(name, plugin_values) for name in names]
    if only is None:
        infos = [i for i in infos if i.section in sections or i.name in also]
    return [field_parameter(i, plugin_values) for i in infos if i.name not in without]


def own_option(name: str, kind: Any, default: Any = None, /, *decls: str, **option: Any) -> inspect.Parameter:
    """A command's own option (not a run option), as a parameter for `command_function`."""
    return inspect.Parameter(name, KEYWORD, default=default, annotation=Annotated[kind, typer.Option(*decls, **option)])


def command_function(name: str, body: Callable[..., Any], params: list[inspect.Parameter], doc: str) -> Any:
    """A function typer reads as the command `name`: the signature `params`, the help `doc`; it hands
    every parsed flag to `body` by keyword."""

    def command(**flags: Any) -> Any:
        return body(**{LISTED_UNDER_FLAG.get(k, k): v for k, v in flags.items()})

    command.__name__ = command.__qualname__ = name
    command.__doc__ = doc
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return command


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
