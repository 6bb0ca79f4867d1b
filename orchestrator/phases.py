"""The phases of a run: one per `--schedule` entry (a run without a schedule is one phase).

A phase is a strategy, its own config (the run's config with that strategy, its default transport,
and only the strategy fields it reads) and a span of global steps. At a switch the driver takes the
state out of the current transport (worker 0's `state()`: a PS snapshot under the parameter server,
the replica itself under the collective; local SGD averages at every epoch end, so that replica is
the averaged model), tears the transport down (workers leave the process group, PS shards are
killed), loads that state into every worker, and sets the next strategy up on the same worker
actors, where its PS shards (if any) are created from the same θ and optimizer state. Model and
optimizer state cross the switch bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from distrain.config import COMMON_FIELDS, RunConfig
from distrain.strategies.strategy_lookup import strategy_class
from distrain.strategies.strategy_schedule import parse_schedule


@dataclass(frozen=True)
class PhaseSpan:
    config: RunConfig  # the phase's own config
    start_step: int
    end_step: int  # exclusive

    def describe(self) -> dict[str, object]:
        return {
            "strategy": self.config.strategy,
            "transport": self.config.transport,
            "start_step": self.start_step,
            "end_step": self.end_step,
        }


def phase_config(config: RunConfig, strategy: str) -> RunConfig:
    """The run's config for one phase: that strategy on its default transport, with only its options."""
    cls = strategy_class(strategy)
    values = {name: value for name, value in config.to_dict().items() if name in COMMON_FIELDS}
    values |= dataclasses.asdict(config.options_of(cls.name))
    values |= {"strategy": strategy, "schedule": "", "transport": cls.transports[0]}
    if cls.transports[0] != "ps":
        values["ps_shards"] = None
    return RunConfig(**values)


def plan_phases(config: RunConfig, steps_per_epoch: int, start_step: int, total: int) -> list[PhaseSpan]:
    """The phases still to run from `start_step` (a checkpoint may start inside a later phase)."""
    if not config.schedule:
        return [PhaseSpan(config, start_step, total)]
    spans = []
    for phase in parse_schedule(config.schedule, config.epochs):
        start = max(phase.start_epoch * steps_per_epoch, start_step)
        end = min(phase.end_epoch * steps_per_epoch, total)
        if start < end:
            spans.append(PhaseSpan(phase_config(config, phase.strategy), start, end))
    return spans
