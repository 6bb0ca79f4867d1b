"""The parameter-server shards' consistency rules (enforced in ps_shard.py; declared by the strategies,
which must not import torch just to say which rule they want)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.compression.spec import FLAG
from distrain.errors import ConfigError
from distrain.strategies.declarations import ColumnPlot, StepColumns

if TYPE_CHECKING:
    from distrain.compression.spec import CodecSpec


def refuse_matrix_codec(codec: CodecSpec, holds: str = "a flat slice of the parameters") -> None:
    """A codec that needs whole matrices (PowerSGD) cannot code what a PS shard holds: a flat slice of the
    parameters (strategies/ps.py), or of each worker's FSDP chunk (strategies/sharded_ps.py)."""
    if codec.needs_shapes:
        raise ConfigError(
            f"{FLAG} {codec} needs whole matrices, but a parameter-server shard holds "
            f"{holds}; use fp16, bf16, int8 or topk:FRACTION there, or --transport collective"
        )


@dataclass(frozen=True)
class ConsistencyRule:
    mode: str  # "rounds" | "bounded" | "portion-rounds" | "sandblaster"
    bound: int | None = None  # bounded mode: max clock lead (SSP's --staleness); None = unbounded (async)
    staleness_lr: bool = False  # bounded mode: divide η by the gradient's staleness
    accept: int | None = None  # rounds mode: gradients that close a round (k-of-n); None = every worker
    # rounds mode under k-of-n across cut replicas (--fsdp D, strategies/sharded_ps.py), and elastic rounds
    # across them: each client's gradient comes in `parts` pieces, piece d to shard d, and a round counts the
    # first `accept` clients (elastic: members - backups of the round's members) whose every piece has
    # arrived, decided once for all shards (`ps_shard.RoundReferee`, on shard 0).
    parts: int = 1
    per_round: int = 0  # portion-rounds mode (bsp's --backup-tasks): portions per round
    lbfgs_memory: int = 0  # sandblaster mode: L-BFGS memory m (pairs each shard keeps slices of)
    # rounds mode under --workers MIN..MAX (`ParameterShard.set_round_members`): a round closes on the
    # current members' pushes (k = members - backups of them under k-of-n), and its rate is rescaled from
    # the global batch of `slots` gradients the schedule's rate is for to the round's, by `lr_scaling`.
    backups: int = 0
    lr_scaling: str = ""  # "": no rescaling (a fixed-size run)
    slots: int = 0

    @classmethod
    def bsp(cls, accept: int | None = None, parts: int = 1) -> ConsistencyRule:
        return cls("rounds", accept=accept, parts=parts)

    @classmethod
    def elastic_bsp(cls, backups: int, lr_scaling: str, slots: int, parts: int = 1) -> ConsistencyRule:
        """`parts` > 1 (cut replicas): the shards agree every round through the referee on shard 0."""
        return cls("rounds", backups=backups, lr_scaling=lr_scaling, slots=slots, parts=parts)

    @classmethod
    def backup_tasks(cls, per_round: int) -> ConsistencyRule:
        return cls("portion-rounds", per_round=per_round)

    @classmethod
    def sandblaster(cls, lbfgs_memory: int) -> ConsistencyRule:
        return cls("sandblaster", lbfgs_memory=lbfgs_memory)

    @classmethod
    def ssp(cls, staleness: int, staleness_lr: bool = False) -> ConsistencyRule:
        # SSP(0) is BSP: a clock's gradients are all computed on the same θ and applied at η/N each, which
        # is one BSP step; the versions its peers' pushes add before a gradient lands are not staleness
        # to damp (dividing by them would break SSP(0) = BSP from 3 workers on).
        return cls("bounded", staleness, staleness_lr and staleness > 0)

    @classmethod
    def asynchronous(cls, staleness_lr: bool = False) -> ConsistencyRule:
        return cls("bounded", None, staleness_lr)


def parameter_server_figures(ps: Any) -> dict[str, Any]:
    """summary.json: staleness, blocked time and traffic of a parameter-server run, from its step rows
    that carry a staleness (a pandas DataFrame)."""
    staleness = ps["staleness"].astype(float)
    return {
        "staleness_p50": float(staleness.quantile(0.5)),
        "staleness_p95": float(staleness.quantile(0.95)),
        "staleness_max": int(staleness.max()),
        "wait_s_total": float(ps["wait_s"].sum()),  # summed over workers
        "wait_s_per_step": float(ps["wait_s"].mean()),  # per worker step
        "bytes_pushed_per_step": float(ps["bytes_sent"].mean()),  # per worker step
        "bytes_pulled_per_step": float(ps["bytes_received"].mean()),
    }


def parameter_server_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """`distrain run`'s closing rows of a parameter-server run (none for a run without its figures)."""
    from distrain.units import size_text

    rows = []
    if summary.get("staleness_p95") is not None:
        rows += [
            (
                "staleness p50 / p95 / max",
                f"{summary['staleness_p50']:g} / {summary['staleness_p95']:g} / {summary['staleness_max']}",
            ),
            ("time blocked (all workers)", f"{summary['wait_s_total']:.2f} s"),
            (
                "pushed / pulled per step",
                f"{size_text(summary['bytes_pushed_per_step'])} / {size_text(summary['bytes_pulled_per_step'])}",
            ),
        ]
    if summary.get("staleness_lr") is not None:  # async, ssp: what their shards applied
        rows.append(("staleness-aware rate (lr / staleness)", "on" if summary["staleness_lr"] else "off"))
    return rows


# What every parameter-server strategy's step rows carry (null under all-reduce), and what they make.
PS_STEP_COLUMNS = StepColumns(
    {
        "wait_s": "float64",  # seconds this step was blocked by the consistency rule
        "read_version": "int64",  # shard version the gradient was computed on
        "applied_version": "int64",  # shard version when it was applied
        "staleness": "int64",  # applied - read (largest over the shards)
        "clock": "int64",  # the worker's clock after this push
        "min_clock": "int64",  # the slowest worker's clock when this step's pull completed
    },
    fields={"staleness": "lag"},  # CommStats.lag: the column keeps the name runs have always had
    key="staleness",
    figures=parameter_server_figures,
    report_column=("staleness p95", "staleness_p95", "g"),
    closing_rows=parameter_server_rows,
    plots=(
        ColumnPlot(
            "staleness_hist.png",
            "staleness",
            "histogram",
            "Staleness of applied gradients",
            "staleness (versions between read and apply)",
            "Staleness of applied gradients (parameter-server strategies).",
        ),
    ),
)
