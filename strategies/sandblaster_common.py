"""What Sandblaster's plain worker (strategies/sandblaster.py) and a cut replica's (strategies/sharded_sandblaster.py)
share: its options, the declarations the driver reads from the strategy class (the PS rule, the shards
and the coordinator, the figures), and the L-BFGS state's checkpoint form. A module of its own so that
sandblaster.py can pick the cut implementation without an import cycle."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError
from distrain.fields import setting
from distrain.strategies.base import Strategy, StrategyOptions
from distrain.strategies.bsp import BACKUP_TASKS_HELP
from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.driver_actor import PS_SHARDS, ActorSetup, DriverActor, ps_shards

if TYPE_CHECKING:
    from distrain.compression import CodecSpec
    from distrain.config import RunConfig

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



class SandblasterDeclarations:
    """The class-level part of Sandblaster, on both its implementations (each lists this first)."""

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


    @classmethod
    def check_codec(cls, config: RunConfig, codec: CodecSpec) -> None:
        Strategy.check_codec.__func__(cls, config, codec)  # type: ignore[attr-defined]

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
        return (ps_shards(cls.ps_rule(config)), coordinator)

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
