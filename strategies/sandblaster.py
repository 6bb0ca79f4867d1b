"""Sandblaster (DistBelief, Dean et al. NIPS'12): a batch optimiser over the parameter-server shards.

`--strategy sandblaster --batch-optimizer lbfgs|gd`. One step of the run is one outer iteration of the
optimiser over the *whole* training set (`full_batch`: one step per epoch, so `--epochs` counts outer
iterations). Three kinds of actor take part:
- the shards (strategies/sandblaster_shard.py): θ, the open pass's accumulators with the record of the
  portions counted, and their slices of the L-BFGS history (strategies/lbfgs.py `ShardState`);
- the coordinator (strategies/sandblaster_coordinator.py, on the driver's side): cuts every data pass
  into --tasks-per-pass portions, hands them out as workers free up, re-issues outstanding ones
  (--backup-tasks; a lost worker's), and drives the optimiser with scalar rounds to the shards;
- the workers (this file): take a portion, read θ of its pass from the shards when they do not hold it
  yet, compute the *summed* loss (and gradient, in a gradient pass) over the portion with the model in
  eval mode (`Task.deterministic_loss`), and add it into the shards; the push goes out with the request
  for the next portion, as under backup tasks.

The line search is backtracking Armijo (t = 1 first, halved, at most 20 trials): each trial costs one
loss pass (forward only), where strong Wolfe would need a gradient pass at every trial point, about
three times the cost, for a curvature condition L-BFGS rarely needs on the smooth problems this serves.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats, Strategy, StrategyContext
from distrain.strategies.ps import PSStrategy
from distrain.strategies.sandblaster_common import (  # (also read from here by the rest of the product)
    BATCH_OPTIMIZERS,
    COORDINATOR,
    DEFAULT_TASKS_PER_WORKER,
    LINE_SEARCH_TRIALS,
    SandblasterDeclarations,
    SandblasterOptions,
    _convert,
    join_states,
    split_state,
)
from distrain.strategies.strategy_names import STRATEGIES

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.trainers.local_trainer import LocalTrainer

__all__ = [
    "BATCH_OPTIMIZERS", "COORDINATOR", "DEFAULT_TASKS_PER_WORKER", "LINE_SEARCH_TRIALS", "Sandblaster",
    "SandblasterOptions", "join_states", "split_state",
]  # fmt: skip


@STRATEGIES.register("sandblaster", "DistBelief Sandblaster: full-batch L-BFGS or GD over the PS shards, tiny tasks")
class Sandblaster(SandblasterDeclarations, PSStrategy):
    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        assert COORDINATOR in ctx.driver_actors, "sandblaster needs the driver's coordinator"
        self.coordinator = ctx.driver_actors[COORDINATOR]
        self.held_pass = -1  # the pass whose θ params_flat holds
        self.record: dict[str, Any] = {}
        self.comm_s = 0.0
        self.portions_done = 0
        self.sent = self.received = 0  # bytes of gradients pushed, of θ pulled, in the last iteration
        # An injected straggler's delay applies per portion here (the unit of work), not per iteration.
        self.slowdown = config.stragglers.get(ctx.rank)

    @classmethod
    def implementation(cls, config: RunConfig) -> type[Strategy]:
        if config.sharded:  # --fsdp D: a replica's D workers take each portion together, worker d at PS shard d
            from distrain.strategies.sharded_sandblaster import ShardedSandblaster

            return ShardedSandblaster
        return cls


    # ------------------------------------------------------------------ one outer iteration
    def run_unit(self, trainer: LocalTrainer, reader: Any, global_step: int) -> tuple[float, int]:
        """Take portions of iteration `global_step`'s passes until the coordinator has finished it."""
        import numpy as np
        import ray

        n = len(reader.dataset)
        samples, finished, comm = 0, None, 0.0
        self.portions_done, self.sent, self.received = 0, 0, 0
        while True:
            t0 = time.perf_counter()
            task = ray.get(self.coordinator.acquire.remote(self.ctx.rank, finished, global_step))
            finished = None
            if task is None:
                break
            if task.pass_id != self.held_pass:
                points = ray.get([s.sb_point.remote(task.pass_id) for s in self.ctx.ps_shards])
                if any(p is None for p in points):
                    comm += time.perf_counter() - t0
                    continue  # that pass closed while we asked (a copy no longer needed)
                params = trainer.params_flat.numpy()
                for (start, stop), p in zip(self.ctx.ps_bounds, points, strict=True):
                    params[start:stop] = p
                self.held_pass = task.pass_id
                self.received += trainer.nbytes
            comm += time.perf_counter() - t0
            lo, hi = task.portion * n // task.of, (task.portion + 1) * n // task.of
            batch = reader.read(np.arange(lo, hi))
            grad = task.kind == "grad"
            started = time.perf_counter()
            loss_sum, count = trainer.portion_sums(batch, with_gradient=grad)
            if self.slowdown:  # --straggler: this worker is slow at every portion it computes
                time.sleep(self.slowdown.extra_s(time.perf_counter() - started))
            g = trainer.grads_flat.numpy() if grad else None
            pushes = [
                shard.sb_add.remote(
                    self.ctx.rank, task.pass_id, task.portion, None if g is None else g[a:b], loss_sum, count
                )
                for shard, (a, b) in zip(self.ctx.ps_shards, self.ctx.ps_bounds, strict=True)
            ]
            finished = (task.pass_id, task.portion, task.copy, pushes)
            self.sent += trainer.nbytes if grad else 0  # a loss pass sends two numbers
            samples += count
            self.portions_done += 1
        t0 = time.perf_counter()
        self.record = ray.get(self.coordinator.record.remote(global_step))
        self.comm_s = comm + time.perf_counter() - t0
        return float(self.record["loss"]), samples

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        r = self.record
        return CommStats(
            seconds=self.comm_s,
            bytes_sent=self.sent,
            bytes_received=self.received,
            extra={k: r.get(k) for k in self.metric_columns if k in r} | {"portions_done": self.portions_done},
        )

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any] | None:
        """The shards' L-BFGS history (with the float64 θ and the pending step) and the coordinator's
        counters: what makes --resume and recovery go on exactly."""
        import ray

        shards = ray.get([s.sb_call.remote("state") for s in self.ctx.ps_shards])
        # As tensors: checkpoints are read back with torch.load(weights_only=True), which takes no numpy.
        return {"shards": _convert(shards, "torch"), "coordinator": ray.get(self.coordinator.state.remote())}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """The shards' states back, at any --ps-shards: a checkpoint's entries are contiguous slices in the
        whole model's order (a plain run's shards; a cut run's one un-permuted entry), so joined they are
        the whole state, cut again at this run's bounds."""
        import ray

        if self.ctx.rank != 0:  # one worker restores the shared state
            return
        parts = _convert(state["shards"], "numpy")
        if len(parts) != len(self.ctx.ps_shards):
            parts = split_state(join_states(parts, None), self.ctx.ps_bounds, None)
        ray.get([s.sb_call.remote("load", part) for s, part in zip(self.ctx.ps_shards, parts, strict=True)])
        ray.get(self.coordinator.load_state.remote(state["coordinator"]))
