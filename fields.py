"""Typed, documented config fields: the one description a flag, a YAML key and `--help` are made from.

Every section of `RunConfig` (config.py) and every strategy's own config dataclass (strategies/) declares
its fields with `setting(...)`: a default, a help text, the help panel it belongs to, and how `--help`
shows its default. `fields_of` reads them back; `coerce` checks a value against a field's type. This
module imports nothing heavy, so the CLI builds its flags and checks them without torch or Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from distrain.errors import ConfigError

# The help panels (and YAML sections) of `distrain run`, in the order --help shows them.
SECTIONS = ("resources", "data", "optimizer", "strategy", "layout", "checkpointing", "faults", "stragglers", "output")


def setting(
    default: Any,
    help: str,
    section: str | None = None,
    shown: str | None = None,
    flag: str = "",
    metavar: str = "",
    derived: bool = False,
) -> Any:
    """A config field: its help text, its section (the CLI's help panel), and the default as `--help`
    shows it when the value itself says little (an empty string); None-valued fields, resolved per
    strategy, state their effective default in the help text instead. `flag`: the CLI's name when it is
    not --<field-name> (--task-arg, --optimizer-arg: one value per use); `metavar`: how --help names its value;
    `derived`: set through another field's value (max_workers, from `--workers MIN..MAX`), so it is neither a
    flag nor a key of its own."""
    meta = {"help": help, "section": section, "shown": shown, "flag": flag, "metavar": metavar, "derived": derived}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class FieldInfo:
    """One field as the CLI, YAML and Tune see it."""

    name: str
    kind: str  # the annotation, e.g. "int", "float | None", "list[str]"
    default: Any
    help: str
    section: str | None
    shown: str | None
    flag: str  # "--tau", "--task-arg"
    metavar: str = ""
    derived: bool = False  # set through another field (not a flag or key of its own)

    @property
    def is_list(self) -> bool:
        return self.kind in ("list[str]", "dict[str, Any]")


def fields_of(cls: type) -> list[FieldInfo]:
    """The documented fields of a config dataclass, in declaration order."""
    infos = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        help_, section, shown = meta.get("help", ""), meta.get("section"), meta.get("shown")
        infos.append(
            FieldInfo(
                f.name, kind, default, help_, section, shown, flag, meta.get("metavar", ""), meta.get("derived", False)
            )
        )
    return infos


def coerce(kind: str, value: Any, flag: str) -> Any:
    """Check (and gently convert) one value against its field's annotation."""
    if kind.endswith(" | None"):
        return None if value is None else coerce(kind.removesuffix(" | None"), value, flag)
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, str):  # YAML 1.1 reads `lr: 1e-3` as the string '1e-3'
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{flag} must be a number, got {value!r}")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} must be true or false, got {value!r}")
        return value
    if kind == "str":
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{flag} must be a string, got {value!r}")
        return value
    if kind == "dict[str, Any]":
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{flag} must be a mapping of names to values, got {value!r}")
        return dict(value)
    if kind == "list[str]":
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{flag} must be a list of strings, got {value!r}")
        return list(value)
    raise TypeError(f"unsupported config field type {kind}")


def build(cls: type, values: dict[str, Any]) -> Any:
    """An instance of config dataclass `cls` from `values` (its own field names), each value checked."""
    known = {info.name: info for info in fields_of(cls)}
    return cls(**{name: coerce(known[name].kind, value, known[name].flag) for name, value in values.items()})
