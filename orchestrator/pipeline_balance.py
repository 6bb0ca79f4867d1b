"""--balance speed over a pipeline's replicas (--pipeline-stages S --workers R): the speed balancer
(balance.py) deciding replica shares in whole sets of the replica's P micro-batches.

A replica's batch is cut into P = --microbatches x --accumulate-steps micro-batches of one size (torch's
schedules receive into buffers sized by the first), so its share is b_r = P x u_r
(config/shares_section.py `replica_shares`): the base balancer works in units of P samples (B / P of
them per step) and what goes out is multiplied back. When a replica's share moves, its micro-batches
change size and its S stages rebuild their torch stage and schedule at that step
(strategies/pipeline.py `compute_gradients`).

Each of the S x R actors' rows is kept on its own (its compute time at the replica's share, the row's
`replica_samples`): a replica's step is as slow as its slowest stage (a stage that computes longer
holds the others up: they wait for it in the schedule or at the stage all-reduce), so a replica's model
is that of the stage whose time at the current share is largest. Pure: tested on plain numbers
(tests/unit/test_pipeline_balance.py).

Cut replicas (--fsdp D, --tensor-parallel T) are balanced by the same class: `stages` is then the D x T
workers of a replica (ranks r x D x T ..), `unit` its D data-parallel ranks, and a replica is as slow
as its slowest worker (FSDP's collectives inside it wait for that one; the average across replicas runs
after the compute, strategies/sharded_bsp.py). The controller makes it for any replica of several
workers (orchestrator/controller/attempt.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from distrain.orchestrator.balance import HISTORY, WINDOW, ShareBalancer, StepModel, fit_step_model


class PipelineShareBalancer(ShareBalancer):
    def __init__(
        self, replicas: int, stages: int, unit: int, global_batch: int, initial: Sequence[int] | None = None, **kw: Any
    ) -> None:
        if global_batch % unit:
            raise ValueError(f"a global batch of {global_batch} is not whole sets of {unit} micro-batches")
        units = [b // unit for b in initial] if initial is not None else None
        super().__init__(replicas, global_batch // unit, units, **kw)
        self.stages, self.unit = stages, unit
        length = max(kw.get("history", HISTORY), kw.get("window", WINDOW))
        self.rows = [deque[tuple[int, float]](maxlen=length) for _ in range(replicas * stages)]  # per actor

    def add_rows(self, rows: dict[str, list[Any]]) -> None:
        """Every stage's rows, each at its replica's share (in units)."""
        self.add(rows["worker"], rows["compute_s"], [n // self.unit for n in rows["replica_samples"]])

    def share_of(self, worker: int) -> int:
        """Actor `worker`'s rows are measured at its replica's current share."""
        return self.current[worker // self.stages]

    def models(self, rows: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[StepModel] | None:
        """Each replica's step model, its slowest stage's, from `rows` (per actor; by default all kept); None
        until every actor has `min_rows` rows at its replica's current share."""
        rows = self.rows if rows is None else rows
        if any(len(self.at_current(a, rows)) < self.min_rows for a in range(len(rows))):
            return None
        S = self.stages
        out = []
        for r, share in enumerate(self.current):
            fitted = [fit_step_model(rows[r * S + s], share, self.window) for s in range(S)]
            out.append(max(fitted, key=lambda m: m.time(share)))
        return out

    def shares_for(self, start_step: int) -> tuple[int, ...]:
        """The replicas' shares in samples (whole sets of micro-batches) of the segment at `start_step`."""
        moved = len(self.moves)
        units = super().shares_for(start_step)
        for move in self.moves[moved:]:
            move["shares"] = [u * self.unit for u in move["shares"]]
        return tuple(u * self.unit for u in units)

    def summary(self) -> dict[str, Any]:
        return {"final_shares": [u * self.unit for u in self.current], "moves": self.moves}
