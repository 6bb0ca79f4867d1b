"""The strategy contract: what happens between "gradients are ready" and "the next batch starts".

A worker actor owns one `LocalTrainer` and one `Strategy`. Per step it computes the gradient into the
trainer's flat buffer, then calls `Strategy.step`, which communicates (all-reduce, push/pull, or
nothing) and applies the update. The strategy returns what it moved, so every metrics row says how
long communication took and how many bytes it cost.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from distrain.config import RunConfig
from distrain.trainers.local_trainer import LocalTrainer


@dataclass(frozen=True)
class StrategyContext:
    """Where a worker stands and how it reaches the others (filled in by the orchestrator)."""

    rank: int
    world_size: int
    device: str
    rendezvous: str  # "host:port" of rank 0's TCP store, for the collective transport


@dataclass
class CommStats:
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


class Strategy(ABC):
    name: ClassVar[str]
    uses_collective: ClassVar[bool] = True

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        self.config = config
        self.ctx = ctx

    def setup(self, trainer: LocalTrainer) -> None:  # noqa: B027 - optional hook
        """Join transports; every worker calls this at the same time."""

    @abstractmethod
    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        """Communicate the gradient in `trainer.grads_flat` and update the parameters."""

    def teardown(self) -> None:  # noqa: B027 - optional hook
        """Leave transports."""
