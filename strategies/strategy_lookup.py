"""Strategies by name: the built-in ones (`distrain strategies` lists them) and, by import path
(`--strategy my_strategy.py:EASGD` or `package.module:Name`), strategies written outside distrain."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.errors import ConfigError
from distrain.plugins import is_import_path, load_object
from distrain.strategies.strategy_names import STRATEGIES

if TYPE_CHECKING:
    from distrain.strategies.base import Strategy

_PLUGINS: dict[str, type[Strategy]] = {}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy `name` means: a built-in name, or an import path to a `Strategy` subclass."""
    if not is_import_path(name):
        import distrain.strategies  # noqa: F401 - registers the built-in strategies

        return STRATEGIES.get(name)
    if name not in _PLUGINS:
        from distrain.strategies.base import Strategy

        obj = load_object(name, "--strategy")
        if not (isinstance(obj, type) and issubclass(obj, Strategy)):
            what = type(obj).__name__ if not isinstance(obj, type) else f"class {obj.__name__}"
            raise ConfigError(f"--strategy {name!r} names a {what}, not a subclass of distrain.strategies.Strategy")
        if not getattr(obj, "name", ""):
            raise ConfigError(f"--strategy {name!r}: {obj.__name__} must set a class attribute `name`")
        _PLUGINS[name] = obj
    return _PLUGINS[name]


def loaded_plugins() -> list[type[Strategy]]:
    """The strategies imported by path so far in this process (their options are known fields)."""
    return list(_PLUGINS.values())
