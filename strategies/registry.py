"""The strategy name registry (`distrain strategies` lists it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.registry import Registry

if TYPE_CHECKING:
    from distrain.strategies.base import Strategy

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")
