"""Elastic averaging SGD (Zhang, Choromanska & LeCun 2015), written outside distrain as a strategy plugin.

    distrain run --strategy examples/strategies/easgd.py:EASGD --elasticity 0.2 --easgd-period 4

Synchronous EASGD: every worker i trains its own replica x_i with the run's optimizer; every `period`
local steps the workers all-reduce their replicas and each one takes the elastic step towards the
center variable x~, which moves towards their mean (beta = workers x alpha, the paper's symmetric choice):

    x_i <- x_i - alpha (x_i - x~)        x~ <- x~ + beta (mean_i x_i - x~)

Every worker holds the same x~ (it is computed from the same all-reduce), so it is checkpointed once.
This file uses only distrain's public API (`from distrain import ...`): the strategy contract, an option
dataclass (two flags), metric columns, a summary figure, checkpointed state, and the strategy's channel
(`self.channel`) for its one all-reduce: --compress, --comm-delay-ms, --comm-bandwidth and the byte
counts apply to it with no code here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distrain import CommStats, ConfigError, Strategy, StrategyOptions, setting


@dataclass(frozen=True)
class EASGDOptions(StrategyOptions):
    elasticity: float = setting(
        0.1, "EASGD: the elastic force alpha pulling each replica to the center (easgd).", "strategy"
    )
    easgd_period: int = setting(4, "EASGD: local steps between elastic averaging rounds (easgd).", "strategy")

    def check(self, run: Any) -> None:
        if not 0 < self.elasticity * run.workers < 1:
            raise ConfigError(f"--elasticity x --workers must be in (0, 1), got {self.elasticity} x {run.workers}")
        if self.easgd_period < 1:
            raise ConfigError(f"--easgd-period must be >= 1, got {self.easgd_period}")


class EASGD(Strategy):
    name = "easgd"
    summary = "elastic averaging SGD: replicas pulled towards a moving center every --easgd-period steps"
    transports = ("collective",)
    Options = EASGDOptions
    metric_columns = {"center_distance": "float64", "elastic_round": "int64"}

    def setup(self, trainer: Any) -> None:
        self.channel.join()
        self.channel.broadcast(trainer.params_flat, src=0)
        self.channel.open("params", shapes=[p.shape for p in trainer.params])  # whole tensors (for PowerSGD)
        self.center = trainer.params_flat.detach().clone()
        self.pending = 0  # local steps since the last elastic round
        self.rounds = 0  # elastic rounds so far (checkpointed: a resumed run goes on counting)

    def step(self, trainer: Any, lr: float) -> CommStats:
        trainer.apply_update(lr)
        self.pending += 1
        if self.pending < self.options.easgd_period:
            return CommStats(extra={"elastic_round": self.rounds})
        return self._elastic_round(trainer)

    def at_epoch_end(self, trainer: Any) -> CommStats | None:
        return self._elastic_round(trainer) if self.pending else None

    def _elastic_round(self, trainer: Any) -> CommStats:
        alpha = self.options.elasticity
        beta = alpha * self.ctx.world_size
        mean = trainer.params_flat.detach().clone()
        traffic = self.channel.all_reduce("params", mean)
        distance = float(torch.linalg.vector_norm(trainer.params_flat - self.center))
        with torch.no_grad():
            trainer.params_flat.sub_(alpha * (trainer.params_flat - self.center))
            self.center.add_(beta * (mean - self.center))
        self.pending = 0
        self.rounds += 1
        extra = {"center_distance": distance, "elastic_round": self.rounds}
        return CommStats(extra=extra).add(traffic)

    def export_state(self, trainer: Any) -> dict[str, Any]:
        """The checkpointed model is the center variable (EASGD's output), not this worker's replica."""
        local = trainer.params_flat.detach().clone()
        with torch.no_grad():
            trainer.params_flat.copy_(self.center)
            state = trainer.state_dict()
            trainer.params_flat.copy_(local)
        return state

    def extra_state(self) -> dict[str, Any]:
        return {"center": self.center.cpu().clone(), "rounds": self.rounds}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.center.copy_(state["center"])
        self.rounds = int(state["rounds"])

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        distances = [d for d in steps.get("center_distance", []) if d is not None and d == d]
        return {
            "elastic_rounds": max((r for r in steps.get("elastic_round", []) if r is not None), default=0),
            "mean_center_distance": sum(distances) / len(distances) if distances else None,
        }
