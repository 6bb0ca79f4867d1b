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

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError
from distrain.fields import setting
from distrain.strategies.base import CommStats, Strategy, StrategyContext, StrategyOptions
from distrain.strategies.bsp import BACKUP_TASKS_HELP
from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.driver_actor import PS_SHARDS, ActorSetup, DriverActor
from distrain.strategies.ps import PSStrategy
from distrain.strategies.strategy_names import STRATEGIES

if TYPE_CHECKING:
    from distrain.compression import CodecSpec
    from distrain.config import RunConfig
    from distrain.trainers.local_trainer import LocalTrainer

BATCH_OPTIMIZERS = ("lbfgs", "gd")
LINE_SEARCH_TRIALS = 20
COORDINATOR = "sandblaster_coordinator"  # its driver-side actor's name (the workers' handle, its figures)
DEFAULT_TASKS_PER_WORKER = 4


@dataclass(frozen=True)
class SandblasterOptions(StrategyOptions):
    batch_optimizer: str = setting(
        "lbfgs", "Batch optimiser of sandblaster: lbfgs or gd (full-batch --lr steps).", "strategy"
    )
    history: int = setting(
        10, "L-BFGS memory m: (s, y) pairs kept, sliced across the shards (sandblaster).", "strategy"
    )
    tasks_per_pass: int | None = setting(
        None, "Portions each data pass is cut into; default 4 x --workers (sandblaster).", "strategy"
    )
    backup_tasks: bool = setting(False, BACKUP_TASKS_HELP, "stragglers")

    def resolved(self, run: RunConfig) -> SandblasterOptions:
        if self.tasks_per_pass is None:
            return dataclasses.replace(self, tasks_per_pass=DEFAULT_TASKS_PER_WORKER * run.workers)
        return self

    def check(self, run: RunConfig) -> None:
        if self.batch_optimizer not in BATCH_OPTIMIZERS:
            raise ConfigError(
                f"unknown --batch-optimizer {self.batch_optimizer!r}; choose one of: {', '.join(BATCH_OPTIMIZERS)}"
            )
        if self.history < 1:
            raise ConfigError(f"--history must be >= 1 (the L-BFGS memory), got {self.history}")
        assert self.tasks_per_pass is not None
        if self.tasks_per_pass < run.workers:
            raise ConfigError(
                f"--tasks-per-pass ({self.tasks_per_pass}) must be at least --workers ({run.workers}) so every "
                "worker gets a portion"
            )
        # Settings of minibatch training that a full-batch method would silently ignore.
        ignored = [
            ("--schedule", bool(run.schedule)),
            ("--momentum", run.momentum is not None),
            ("--optimizer", run.optimizer != "sgd"),
            ("--optimizer-arg", bool(run.optimizer_args)),
            ("--warmup-epochs", run.warmup_epochs != 0),
            ("--lr-decay", run.lr_decay != "none"),
            ("--lr", self.batch_optimizer == "lbfgs" and run.lr != run.field_info("lr").default),
            # Its passes compute exact float32 sums in eval mode (LocalTrainer.portion_sums), no autocast.
            ("--precision", run.precision != "fp32"),
            # A pass is the whole training set already, and L-BFGS's step length comes from its line search.
            ("--accumulate-steps", run.accumulate_steps != 1),
            ("--clip-grad-norm", bool(run.clip_grad_norm)),
        ]
        for flag, given in ignored:
            if given:
                why = " (L-BFGS takes no learning rate)" if flag == "--lr" else ""
                raise ConfigError(f"--strategy sandblaster ignores {flag}{why}; drop it")


@STRATEGIES.register("sandblaster", "DistBelief Sandblaster: full-batch L-BFGS or GD over the PS shards, tiny tasks")
class Sandblaster(PSStrategy):
    name = "sandblaster"
    Options = SandblasterOptions
    full_batch = True
    reissues_lost_work = True
    compresses = ""
    metric_columns = {
        "grad_norm": "float64",
        "step_length": "float64",
        "line_search_evals": "int64",
        "data_passes": "int64",
        "portions_reissued": "int64",
        "backups_used": "int64",
        "portions_done": "int64",
    }

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
    def check_codec(cls, config: RunConfig, codec: CodecSpec) -> None:
        Strategy.check_codec.__func__(cls, config, codec)  # type: ignore[attr-defined]

    @classmethod
    def implementation(cls, config: RunConfig) -> type[Strategy]:
        if config.sharded:  # --fsdp D: a replica's D workers take each portion together, worker d at PS shard d
            from distrain.strategies.sharded_sandblaster import ShardedSandblaster

            return ShardedSandblaster
        return cls

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        return ConsistencyRule.sandblaster(config.options_of(cls.name).history)

    @classmethod
    def driver_actors(cls, config: RunConfig) -> tuple[DriverActor, ...]:
        """The shards, then the coordinator that drives them (it is built with their handles)."""
        from distrain.strategies.sandblaster_coordinator import SandblasterCoordinator

        def args(setup: ActorSetup) -> dict[str, Any]:
            shards = setup.started[PS_SHARDS].shards
            return {"shards": shards, "start_iteration": setup.start_step, **cls.coordinator_args(setup.phase)}

        coordinator = DriverActor(
            COORDINATOR,
            SandblasterCoordinator,
            args=args,
            ready=lambda actor, setup: [actor.start.remote()],  # opens the first pass on the shards
            notices=("worker_lost", "mark_slow"),
        )
        return (*super().driver_actors(config), coordinator)

    @classmethod
    def check_data(cls, config: RunConfig, num_samples: int) -> None:
        per_pass = config.options_of(cls.name).tasks_per_pass
        if per_pass > num_samples:
            raise ConfigError(f"--tasks-per-pass ({per_pass}) exceeds the {num_samples} training samples; lower it")
        d = config.replica_grid[0]
        if num_samples // per_pass < d:  # across cut replicas each of a replica's D workers takes part of a portion
            raise ConfigError(
                f"--tasks-per-pass ({per_pass}) cuts the {num_samples} training samples into portions smaller than "
                f"--fsdp {d} (each of a replica's {d} workers takes part of every portion); lower it"
            )

    @classmethod
    def coordinator_args(cls, config: RunConfig) -> dict[str, Any]:
        """What the driver builds the coordinator with (besides the shards and the first iteration)."""
        options = config.options_of(cls.name)
        return {
            "batch_optimizer": options.batch_optimizer,
            "tasks_per_pass": options.tasks_per_pass,
            "copies": options.backup_tasks,
            "lr": config.lr,
            "line_search_trials": LINE_SEARCH_TRIALS,
        }

    @classmethod
    def actor_figures(cls, config: RunConfig, actors: dict[str, Any]) -> dict[str, Any]:
        import ray

        coordinator = actors.get(COORDINATOR)
        return {f"sandblaster_{k}": v for k, v in ray.get(coordinator.stats.remote()).items()} if coordinator else {}

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        """Per outer iteration every worker's row carries the same figures: read one row per step."""
        if not steps.get("step"):
            return {}
        first: dict[int, int] = {}
        for i, step in enumerate(steps["step"]):
            first.setdefault(step, i)
        rows = [first[s] for s in sorted(first)]

        def col(name: str) -> list[Any]:
            return [steps[name][i] for i in rows if steps[name][i] is not None]

        losses = col("loss")
        return {
            "outer_iterations": len(rows),
            "final_full_batch_loss": losses[-1] if losses else None,
            "data_passes": max(col("data_passes"), default=0),
            "line_search_evals": sum(col("line_search_evals")),
            "portions_reissued": sum(col("portions_reissued")),
            "backups_used": sum(col("backups_used")),
        }

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


def _map_state(state: dict[str, Any], fn: Any) -> dict[str, Any]:
    """`fn` on every vector of a `ShardState.state()` (θ, the (s, y) lists, the last gradient and step)."""
    return {k: [fn(x) for x in v] if isinstance(v, list) else None if v is None else fn(v) for k, v in state.items()}


def join_states(parts: list[dict[str, Any]], unpermute: Any) -> dict[str, Any]:
    """Shards' `ShardState.state()`s joined into one over the whole θ: every vector concatenated in shard
    order, then `unpermute`d (a cut run's shards' order back into the model's; None: contiguous already)."""
    import numpy as np

    if len(parts) == 1 and unpermute is None:
        return parts[0]

    def join(vectors: list[Any]) -> Any:
        whole = np.concatenate(vectors)
        return whole if unpermute is None else unpermute(whole)

    first = parts[0]
    out: dict[str, Any] = {}
    for k, v in first.items():
        if isinstance(v, list):
            out[k] = [join([p[k][i] for p in parts]) for i in range(len(v))]
        else:
            out[k] = None if v is None else join([p[k] for p in parts])
    return out


def split_state(whole: dict[str, Any], bounds: Any, permute: Any) -> list[dict[str, Any]]:
    """The inverse of `join_states`: the whole state `permute`d into this run's shards' order (None: as
    is), cut at the shards' `bounds`."""
    ordered = whole if permute is None else _map_state(whole, permute)
    return [_map_state(ordered, lambda x, a=a, b=b: x[a:b].copy()) for a, b in bounds]


def _convert(obj: Any, to: str) -> Any:
    """numpy arrays to torch tensors (to="torch") or back (to="numpy"), through dicts and lists."""
    import numpy as np
    import torch

    if isinstance(obj, dict):
        return {k: _convert(v, to) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_convert(v, to) for v in obj]
    if to == "torch" and isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if to == "numpy" and isinstance(obj, torch.Tensor):
        return obj.numpy()
    return obj
