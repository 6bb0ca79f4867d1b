"""Ray Data input: a task whose `datasets()` returns a `ray.data.Dataset` to train on (docs/raydata.md).

The driver builds the Dataset once, in its check of the task, and counts its rows once (`count()`):
an epoch is `rows // global batch` steps, as for a map-style set. For each attempt it hands worker r
the r-th iterator of `streaming_split(n, equal=True)`, as Ray Train does: every shard holds the same
number of rows, so every worker has the same number of full batches an epoch and none waits at a
collective for a shard that ran dry. A worker reads its shard in order, one batch of B rows per unit of
its fixed work plan; nothing is read by index. So only strategies whose workers each compute the units
of a fixed plan, one replica each, take a Dataset (`Strategy.streams_data`: BSP, local SGD and DiLoCo
over the collective); the others, and elastic, layout and Tune runs, are refused in one line.

Ray Data runs its tasks on CPUs the workers do not hold: the run needs at least `DATA_CPUS` of them
free (a local Ray distrain starts gets them), and the Dataset's budget is what the workers leave
(`resource_limits`; Ray Train excludes its workers' resources from it the same way). With every CPU held
by a worker, `streaming_split` would wait forever.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from distrain.config import RunConfig
from distrain.config.shares_section import unequal_shares
from distrain.errors import ConfigError

DATA_CPUS = 1  # CPUs left free of workers for Ray Data's tasks, at the least
STREAMING_STRATEGIES = "bsp, local-sgd or diloco"  # those with `streams_data`, for the refusal


def is_dataset(obj: Any) -> bool:
    """Whether `obj` is a Ray Data `Dataset` (without importing Ray Data for a task that never did)."""
    ray_data = sys.modules.get("ray.data")
    return ray_data is not None and isinstance(obj, ray_data.Dataset)


def datasets_lazily(task: Any, start_ray: Callable[[], None] | None) -> Any:
    """`task.datasets()` in the driver, before distrain has started Ray. Ray Data's readers only plan
    their work (nothing is read until the Dataset is), but would start a Ray of their own on the way
    (`ray.init()`, Ray's automatic start): that is turned off for the call, so the Ray the run uses is
    the one distrain starts, sized for its workers and its data. A Dataset built from data in memory
    (`from_items`, `from_numpy`) needs Ray at once: then Ray is started (`start_ray`) and the call repeated."""
    import ray

    hook = sys.modules.get("ray._private.auto_init_hook")
    if hook is None or ray.is_initialized():
        return task.datasets()
    before = hook.enable_auto_connect
    hook.enable_auto_connect = False
    try:
        return task.datasets()
    except ray.exceptions.RaySystemError:
        if ray.is_initialized() or start_ray is None:
            raise
    finally:
        hook.enable_auto_connect = before
    start_ray()
    return task.datasets()


def by_value(task: Any) -> None:
    """Let Ray pickle the functions of a task's own file by value: distrain imports a `--task file.py`
    under a name of its own (plugins.py), which the processes Ray Data runs its stages in cannot import."""
    import inspect

    import ray

    from distrain.plugins import USER_MODULE_PREFIX, is_lone_module

    module = inspect.getmodule(type(task))
    if module is not None and (module.__name__.startswith(USER_MODULE_PREFIX) or is_lone_module(module)):
        ray.cloudpickle.register_pickle_by_value(module)


def refusal(config: RunConfig) -> str | None:
    """Why this run cannot read a streamed training set (what assigns samples by index), or None."""
    if config.elastic:
        return f"--workers {config.workers}..{config.max_workers} (elastic) re-deals a leaver's samples by index"
    if unequal_shares(config):  # equal=True shards: every worker reads the same rows per step
        return "--worker-weights / --worker-group / --balance speed give workers unequal shares of each step"
    d, t, s = config.replica_grid
    cut = [f"{flag} {n}" for flag, n in (("--fsdp", d), ("--tensor-parallel", t), ("--pipeline-stages", s)) if n > 1]
    if cut:
        return f"{' '.join(cut)} cuts a replica over several workers, which must read the same samples"
    for strategy in config.strategy_classes:
        impl = strategy.implementation(config)
        if not impl.streams_data:
            how = f" over --transport {config.transport}" if config.transport != "collective" else ""
            return f"--strategy {strategy.name}{how} assigns samples to workers by index"
    return None


def check_streamable(config: RunConfig) -> None:
    """Refuse, in one line, a run whose training set is a Ray Dataset that it cannot stream."""
    why = refusal(config)
    if why is not None:
        raise ConfigError(
            f"--task {config.task}: its training set is a Ray Dataset, which streams, and {why}; use --strategy "
            f"{STREAMING_STRATEGIES} over the collective transport with a fixed --workers, or return a map-style "
            "torch Dataset"
        )


# ---------------------------------------------------------------------- the driver's Dataset
@dataclass
class Streamed:
    """The training Dataset of this driver's run, as its check of the task built it, and its rows."""

    train: Any  # ray.data.Dataset
    rows: int
    key: tuple[Any, ...]  # the task it was built for (`_key`)


_streamed: Streamed | None = None  # set by the task's check, read by `train_size` and the worker group


def _key(config: RunConfig) -> tuple[Any, ...]:
    return (config.task, repr(sorted(config.task_args.items())), id(config.__dict__.get("_task_object")))


def prepare(config: RunConfig, train: Any, start_ray: Callable[[], None] | None) -> int:
    """Count `train`'s rows once (Ray started first, if it is not: `start_ray`), and keep the Dataset for
    the workers' shards. Returns the rows."""
    global _streamed
    import ray

    if not ray.is_initialized():
        if start_ray is None:  # `distrain plan`, `distrain tune`: nothing to start Ray for the data with
            raise ConfigError(
                f"--task {config.task}: its training set is a Ray Dataset, which `distrain plan`, `distrain tune` and "
                f"--strategy auto do not stream; name --strategy {STREAMING_STRATEGIES} to `distrain run` or "
                "distrain.fit, or return a map-style torch Dataset"
            )
        start_ray()
    if ray.util.get_current_placement_group() is not None:  # a Tune trial: every CPU of its group is a worker's
        raise ConfigError(
            f"--task {config.task}: its training set is a Ray Dataset, which a Tune trial cannot stream "
            "(its placement group leaves Ray Data no CPU); return a map-style torch Dataset for sweeps"
        )
    quiet(train)
    rows = int(train.count())
    _streamed = Streamed(train, rows, _key(config))
    return rows


def quiet(ds: Any) -> None:
    """No progress bars or plan printed for the Dataset's executions (the run has its own display); only
    Ray Data's warnings reach the driver's output. (The split's coordinator still says when an epoch's
    execution finishes.)"""
    import logging

    context = ds.context
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def forget() -> None:
    """Drop the Dataset of an earlier run in this process (each check of a task starts afresh)."""
    global _streamed
    _streamed = None


def prepared(config: RunConfig) -> Streamed | None:
    """The streamed training set the check of `config`'s task prepared, if it was one."""
    return _streamed if _streamed is not None and _streamed.key == _key(config) else None


@dataclass
class Shard:
    """What one worker streams: its iterator of `streaming_split`, the Dataset's rows, its batch."""

    iterator: Any  # ray.data.DataIterator
    rows: int
    batch: int  # rows a unit reads


def shards(streamed: Streamed, config: RunConfig, held_cpus: float) -> list[Shard]:
    """One shard per worker actor, of a fresh `streaming_split` (an attempt's workers all start anew);
    `held_cpus`: the CPUs the run's actors hold (`cluster.cpus_needed`)."""
    import ray

    n = config.num_worker_actors
    ds = streamed.train
    # Ray Data's budget is what the workers leave (Ray Train excludes its workers' resources the same way;
    # `exclude_resources` itself is deprecated in Ray 2.60): with the whole cluster as its budget it would
    # count on CPUs it can never get.
    total = ray.cluster_resources()
    options = ds.context.execution_options
    options.resource_limits = options.resource_limits.copy(
        cpu=max(float(DATA_CPUS), total.get("CPU", 0.0) - held_cpus),
        gpu=max(0.0, total.get("GPU", 0.0) - n * config.gpus_per_worker),
    )
    batch = config.samples_per_step // n
    return [Shard(it, streamed.rows, batch) for it in ds.streaming_split(n, equal=True)]


# ---------------------------------------------------------------------- a worker's side
class StreamReader:
    """A worker's batches from its shard: epoch e's stream is opened at e's first unit this worker
    computes and closed after the epoch's last step (a run resumed mid-epoch reads the rest of that
    epoch's steps from a fresh pass: the same number of steps, not the same rows)."""

    def __init__(self, shard: Shard, collate: Callable[[dict[str, Any]], Any], steps_per_epoch: int) -> None:
        self.shard = shard
        self.collate = collate
        self.steps_per_epoch = steps_per_epoch
        self.epoch: int | None = None
        self._batches: Iterator[dict[str, Any]] | None = None

    def read(self, epoch: int, step: int) -> tuple[Any, int]:
        """The batch of unit (epoch, step) and its rows."""
        if epoch != self.epoch or self._batches is None:
            self.close()
            self.epoch = epoch
            self._batches = iter(
                self.shard.iterator.iter_batches(
                    batch_size=self.shard.batch, batch_format="numpy", drop_last=True, prefetch_batches=1
                )
            )
        try:
            columns = next(self._batches)
        except StopIteration:
            raise ConfigError(
                f"the training Dataset ran out at step {step} of epoch {epoch} ({self.steps_per_epoch} steps of "
                f"{self.shard.batch} rows a worker were counted from its {self.shard.rows} rows): it changed "
                "since the run counted it"
            ) from None
        if step + 1 >= self.steps_per_epoch:
            self.close()  # tells the split this worker is done with the epoch (the rest is under one batch)
        rows = len(next(iter(columns.values()))) if columns else 0
        return self.collate(columns), rows

    def close(self) -> None:
        batches, self._batches = self._batches, None
        if batches is not None and hasattr(batches, "close"):
            batches.close()


def test_batches(test: Any, collate: Callable[[dict[str, Any]], Any], share: int, batch: int) -> Iterator[Any]:
    """A streamed test set's batches for evaluation share `share`: share 0 streams the whole set (a
    plain `iter_batches`, no split: no other worker needs to read in step with it), the others none."""
    if share != 0:
        return
    for columns in test.iter_batches(batch_size=batch, batch_format="numpy"):
        yield collate(columns)
