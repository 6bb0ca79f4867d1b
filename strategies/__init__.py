"""Consistency strategies and their transports. Importing this package registers every strategy."""

from distrain.strategies import bsp  # noqa: F401  (registers "bsp")
from distrain.strategies.registry import STRATEGIES

__all__ = ["STRATEGIES"]
