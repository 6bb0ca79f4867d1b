"""The built-in strategies' table, which each strategy module registers itself into at import (`bsp`,
`async`, ...). Apart from strategies/strategy_lookup.py, which resolves a name by importing the package
(so that every built-in has registered): were the table there, lookup and strategies would import each
other."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.name_registry import Registry

if TYPE_CHECKING:
    from distrain.strategies.base import Strategy

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")
