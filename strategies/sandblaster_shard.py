"""The parameter-server shard under Sandblaster: a `ParameterShard` that also holds its `ShardState`.

strategies/ps_shard_group.py starts this class for the "sandblaster" rule. It keeps the standard shard's θ (the
float32 slice that `pull`, `snapshot` and checkpoints read) equal to the float64 master copy in the
`ShardState` after every move, so evaluation, checkpoints and phase logic need nothing new. Workers call
`sb_point` (θ of a pass) and `sb_add` (a portion's sums); the coordinator calls `sb_call` (one
`ShardState` method by name). Portions add into one accumulator on arrival: the shard keeps only the
set of portion ids counted in the open pass, not a gradient per portion.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from distrain.strategies.lbfgs import ShardState
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard

# What the coordinator may ask of a shard's state (nothing else is reachable through `sb_call`).
COMMANDS = frozenset(
    {
        "open_pass",
        "close_grad",
        "close_loss",
        "form_pair",
        "keep_pair",
        "history_length",
        "clear_history",
        "gram",
        "set_direction",
        "set_trial",
        "accept",
        "reject",
        "gd_step",
        "state",
        "load",
    }
)
MOVES_THETA = frozenset({"accept", "gd_step", "reject", "load"})  # after these, an iteration is over


class SandblasterShard(ParameterShard):
    def __init__(
        self,
        shard_id: int,
        num_workers: int,
        rule: ConsistencyRule,
        optimizer: OptimizerSpec,
        theta: np.ndarray,
        optimizer_state: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(shard_id, num_workers, rule, optimizer, theta, optimizer_state)
        self.sb = ShardState(theta, rule.lbfgs_memory, optimizer.weight_decay or 0.0)

    async def sb_point(self, pass_id: int) -> np.ndarray | None:
        """θ (or the trial point) of pass `pass_id`, float32; None once that pass is closed."""
        return self.sb.point(pass_id)

    async def sb_add(self, worker: int, pass_id: int, portion: int, grad: Any, loss_sum: float, count: int) -> bool:
        """One portion's summed gradient slice (None in a loss pass) and loss; True if this copy counted."""
        counted = self.sb.add(pass_id, portion, grad, loss_sum, count)
        if not counted:
            self.dropped[worker] += 1
        return counted

    async def sb_call(self, method: str, *args: Any) -> Any:
        if method not in COMMANDS:
            raise ValueError(f"shard {self.shard_id}: no Sandblaster command {method!r}")
        result = getattr(self.sb, method)(*args)
        if method in MOVES_THETA:
            async with self.changed:
                np.copyto(self.theta, self.sb.theta.astype(np.float32))
                if method != "load":
                    self.version += 1
                    self.updates_applied += 1
                self.changed.notify_all()
        return result
