"""Consistency strategies and their transports. Importing this package registers every strategy."""

from distrain.strategies import bsp, diloco, local_sgd, ps, sandblaster  # noqa: F401  (registers "bsp", "diloco", "local-sgd", "async", "ssp", "sandblaster")
from distrain.strategies.strategy_names import STRATEGIES

__all__ = ["STRATEGIES"]
