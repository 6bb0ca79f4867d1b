"""Name -> class registries (strategies, models, data sets).

Duplicate names are refused at import time; unknown names are answered with the valid ones, so a
typo on the command line gets a useful one-line error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from distrain.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, help: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("name", "one-line description")`."""

        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            self._help[name] = help
            return obj

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}") from None

    def check(self, name: str) -> None:
        self.get(name)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self) -> dict[str, str]:
        return {name: self._help[name] for name in self.names()}

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
