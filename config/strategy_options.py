"""The strategies a run uses and their own options (each strategy's `Options` dataclass): which options
exist (the built-in strategies', and those of strategies imported by path), and each strategy's options
built from a run's flat values, refusing an option no strategy of the run reads. No torch, no Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrain.config.sections import COMMON_FIELDS, STRATEGY_COMMON_DEPENDENT
from distrain.errors import ConfigError
from distrain.fields import FieldInfo, coerce, fields_of

if TYPE_CHECKING:
    from distrain.config.run_config import RunConfig
    from distrain.strategies.base import Strategy


def strategies_named(strategy: str, schedule: str = "", epochs: int = 0) -> list[type[Strategy]]:
    """The strategy classes a run uses: its strategy, or every one its --schedule names (in order, once)."""
    from distrain.strategies.strategy_lookup import strategy_class

    names = [strategy]
    if schedule:
        from distrain.strategies.strategy_schedule import parse_schedule

        names = [p.strategy for p in parse_schedule(schedule, max(epochs, 1))]
    return [strategy_class(n) for n in dict.fromkeys(names)]


def option_fields(classes: list[type[Strategy]] | None = None) -> dict[str, FieldInfo]:
    """The strategies' own options by name (the built-in strategies' when `classes` is None)."""
    if classes is None:
        from distrain.strategies import STRATEGIES

        classes = [STRATEGIES.get(n) for n in STRATEGIES.names()]
    found: dict[str, FieldInfo] = {}
    for cls in classes:
        for info in fields_of(cls.Options):
            found.setdefault(info.name, info)
    return found


def known_option_fields() -> dict[str, FieldInfo]:
    """Options of the built-in strategies and of those imported by path so far in this process."""
    from distrain.strategies.strategy_lookup import loaded_plugins

    return option_fields() | option_fields(loaded_plugins())


def strategy_dependent_fields() -> tuple[str, ...]:
    return STRATEGY_COMMON_DEPENDENT + tuple(known_option_fields())


def plugin_option_fields(values: dict[str, Any]) -> dict[str, FieldInfo]:
    """Options of strategies `values` names by import path (built-in ones are known already)."""
    from distrain.plugins import is_import_path

    name = str(values.get("strategy") or "")
    if not is_import_path(name):
        return {}
    from distrain.strategies.strategy_lookup import strategy_class

    return option_fields([strategy_class(name)])


def strategy_options(run: RunConfig, values: dict[str, Any]) -> dict[str, Any]:
    """Each strategy's own options from the flat `values`, resolved against `run`; an option given for
    a strategy this run does not use is refused, naming the strategies that use it."""
    from distrain.fields import build

    phases = run.strategy_classes
    mine = option_fields(phases)
    known = known_option_fields() | mine
    options = {}
    for cls in phases:
        names = {info.name for info in fields_of(cls.Options)}
        given = {k: v for k, v in values.items() if k in names}
        options[cls.name] = build(cls.Options, given).resolved(run)
    user = f"--schedule {run.schedule}" if run.schedule else f"--strategy {run.strategy}"
    for name, value in values.items():
        if name in COMMON_FIELDS or name in mine:
            continue
        if name not in known:
            valid = list(COMMON_FIELDS) + list(known)
            raise ConfigError(f"unknown config field {name!r}; valid fields: {', '.join(valid)}")
        given_value = None if value is None else coerce(known[name].kind, value, known[name].flag)
        # An on/off option given as off asks nothing of a strategy that has no such thing (--no-staleness-lr
        # with bsp; flat config files of earlier versions wrote every unused switch as false).
        if given_value is not None and given_value is not False and given_value != known[name].default:
            from distrain.strategies import STRATEGIES
            from distrain.strategies.strategy_lookup import loaded_plugins

            classes = [STRATEGIES.get(n) for n in STRATEGIES.names()] + loaded_plugins()
            users = [c.name for c in classes if name in {i.name for i in fields_of(c.Options)}]
            raise ConfigError(
                f"--{name.replace('_', '-')} is not used by {user}; drop it (it applies to: {', '.join(users)})"
            )
    return options
