"""The parameter-server shards' consistency rules (enforced in ps_shard.py; declared by the strategies,
which must not import torch just to say which rule they want)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConsistencyRule:
    mode: str  # "rounds" | "bounded" | "portions" | "sandblaster"
    staleness: int | None = None  # bounded mode: max clock lead; None = unbounded (async)
    staleness_lr: bool = False  # bounded mode: divide η by the gradient's staleness
    accept: int | None = None  # rounds mode: gradients that close a round (k-of-n); None = every worker
    portions: int = 0  # portions mode: portions per round
    history: int = 0  # sandblaster mode: L-BFGS memory m (pairs each shard keeps slices of)
    # rounds mode under --workers MIN..MAX (`ParameterShard.set_round_members`): a round closes on the
    # current members' pushes (k = members - backups of them under k-of-n), and its rate is rescaled from
    # the global batch of `slots` gradients the schedule's rate is for to the round's, by `lr_scaling`.
    backups: int = 0
    lr_scaling: str = ""  # "": no rescaling (a fixed-size run)
    slots: int = 0

    @classmethod
    def bsp(cls, accept: int | None = None) -> ConsistencyRule:
        return cls("rounds", accept=accept)

    @classmethod
    def elastic_bsp(cls, backups: int, lr_scaling: str, slots: int) -> ConsistencyRule:
        return cls("rounds", backups=backups, lr_scaling=lr_scaling, slots=slots)

    @classmethod
    def backup_tasks(cls, portions: int) -> ConsistencyRule:
        return cls("portions", portions=portions)

    @classmethod
    def sandblaster(cls, history: int) -> ConsistencyRule:
        return cls("sandblaster", history=history)

    @classmethod
    def ssp(cls, staleness: int, staleness_lr: bool = False) -> ConsistencyRule:
        # SSP(0) is BSP: a clock's gradients are all computed on the same θ and applied at η/N each, which
        # is one BSP step; the versions its peers' pushes add before a gradient lands are not staleness
        # to damp (dividing by them would break SSP(0) = BSP from 3 workers on).
        return cls("bounded", staleness, staleness_lr and staleness > 0)

    @classmethod
    def asynchronous(cls, staleness_lr: bool = False) -> ConsistencyRule:
        return cls("bounded", None, staleness_lr)
