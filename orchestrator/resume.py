"""`distrain run --resume runs/X`: continue a run whose driver stopped (killed, crashed, Ctrl-C).

The run's own config.yaml is the configuration; flags may change only what does not change the
training math (how long, how often to evaluate or checkpoint, timeouts, fault handling, resources),
and config.yaml must still agree with the configuration its checkpoint recorded on everything else
(an edited file is refused as the flag would be). The run continues from its newest complete
checkpoint (`checkpoints/latest.json`), with the failures it recorded and the metrics rows of
metrics.parquet before its step. Every refusal is one line naming the fix, is given before Ray
starts, and writes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from distrain.config import LEGACY_MOMENTUM, RunConfig, format_workers, parse_workers
from distrain.config.layout_section import GLOBAL_BATCH, LAYOUT_FIELDS, global_batch_of
from distrain.errors import ConfigError, DistrainError
from distrain.orchestrator.checkpoint import LATEST, latest_checkpoint, load_checkpoint_for, whole_checkpoint
from distrain.orchestrator.checkpoint_schedule import run_steps
from distrain.orchestrator.metrics import EVAL_PREFIXES, LOGGED_PREFIX, SCHEMA, MetricsSink
from distrain.trainers.datasets import DATASETS
from distrain.trainers.splits import train_part_size

# Flags a resumed run may change: none of them changes what one step computes.
RESUMABLE = frozenset(
    {
        "epochs",
        "max_steps",
        "eval_every",
        "test_every_epoch",
        "checkpoint_best",
        "tensorboard",
        "loggers",
        "mlflow_uri",
        "storage",
        "checkpoint_every",
        "checkpoint_steps",
        "max_failures",
        "hang_timeout_s",
        "collective_timeout_s",
        "chaos",
        "target_accuracy",
        "segment_steps",
        "address",
        "placement",
        "cpus_per_worker",
        "cpus_per_shard",
        "worker_memory",
        "gpus_per_worker",
        "straggler",
        "data_dir",
        "on_nonfinite",
    }
)
# metrics.parquet columns added to the schema after runs had been written without them (resumable still).
ADDED_COLUMNS = ("overflow",)
# A checkpoint from another run must agree on these to be continued here.
IDENTITY = ("strategy", "transport", "model", "dataset", "workers", "batch_size", "seed", "optimizer")


def relayout_allowed(config: RunConfig) -> bool:
    """Whether a run so configured keeps its update at another layout (config/layout_section.py's
    `LAYOUT_FIELDS`) with the same global batch R x D x B: BSP over the collective transport at a fixed
    size, without a schedule or a codec (whose error feedback is per rank). Its steps then take the same
    samples in the same order (trainers/sharding.py), and any layout restores its checkpoints (a
    pipeline's stages are gathered into one; a sharded replica's DCP shards reshard on load or are read
    whole, trainers/sharded_checkpoint.py). Also Sandblaster at a fixed size without a schedule: its step
    is one pass over the whole training set at any layout (no global batch to keep), and its checkpoint,
    the L-BFGS state included, is whole (strategies/sharded_sandblaster.py), cut again at load."""
    if config.strategy == "sandblaster":
        return not config.elastic and not config.schedule
    return (
        config.strategy == "bsp"
        and config.transport == "collective"
        and not config.elastic
        and not config.schedule
        and config.compress is None
    )


def check_relayout(recorded: dict[str, Any], config: RunConfig) -> None:
    """A resume at another layout keeps the global batch (ConfigError otherwise, naming the flags)."""
    changed = sorted(n for n in LAYOUT_FIELDS if n in recorded and not _same(n, recorded[n], config))
    low, high = parse_workers(recorded["workers"])
    before = global_batch_of(recorded, high or low)
    full_batch = any(cls.full_batch for cls in config.strategy_classes)  # (Sandblaster: no batch to keep)
    if changed and before != config.global_batch_size and not full_batch:
        flags = ", ".join("--" + n.replace("_", "-") for n in changed)
        raise ConfigError(
            f"--resume cannot change {flags} here: the global batch ({GLOBAL_BATCH}) would go "
            f"from {before} to {config.global_batch_size}, and the data order with it; keep it at {before}, or "
            "start a new run with --init-from its checkpoint"
        )


def resume_config(run_dir: str | Path, overrides: dict[str, Any]) -> RunConfig:
    """The configuration of the run in `run_dir`, with the (resumable) flags in `overrides` applied."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"--resume {str(path)!r} is not a directory; pass a run directory such as runs/<id>")
    recorded_file = path / "config.yaml"
    if not recorded_file.is_file():
        raise ConfigError(
            f"--resume {str(path)!r} is not a distrain run (no config.yaml); pass a directory written by `distrain run`"
        )
    if not (path / "checkpoints" / LATEST).is_file():  # a run that failed or diverged before its first one
        raise ConfigError(no_checkpoint(path))
    recorded = RunConfig.resolve(str(recorded_file), {})
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("run_dir") not in (None, "", str(path), recorded.run_dir):
        raise ConfigError("--resume continues the run in its own directory; drop --run-dir")
    given.pop("run_dir", None)
    if given.get("init_from"):
        raise ConfigError("--resume continues from the run's own checkpoint; drop --init-from")
    recorded_values = recorded.to_dict()
    relayout = relayout_allowed(recorded)
    for name, value in given.items():
        if relayout and name in LAYOUT_FIELDS:
            continue  # checked as a whole once the new config is built
        if name == "workers":  # ranges compare as ranges: "2..4" is the run's 2..4, "3" its 3
            if parse_workers(value) != (recorded.workers, recorded.max_workers):
                has = format_workers(recorded.workers, recorded.max_workers)
                raise ConfigError(
                    f"--resume cannot change --workers (the run has {has}, got {value}); drop it, or start a new "
                    "run with --init-from its checkpoint"
                )
            continue
        if name in RESUMABLE:
            continue
        # Flat keys as config.yaml holds them; an option of a strategy the run does not use is unset there.
        has = recorded_values[name] if name in recorded_values else RunConfig.field_info(name).default
        if _plain(value) != _plain(has):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"--resume cannot change {flag} (the run has {has!r}, got {value!r}); drop it, "
                "or start a new run with --init-from its checkpoint"
            )
    if recorded.lr_decay == "cosine":
        for name in ("epochs", "max_steps"):
            if name in given and given[name] != getattr(recorded, name):
                raise ConfigError(
                    f"--resume cannot change --{name.replace('_', '-')} of a run with --lr-decay cosine: the run's "
                    "length is the cosine's horizon, so the rate would jump; drop it"
                )
    kept = RESUMABLE | LAYOUT_FIELDS if relayout else RESUMABLE
    values = recorded.to_dict() | {k: v for k, v in given.items() if k in kept} | {"run_dir": str(path)}
    config = RunConfig.from_mapping(values, str(recorded_file))
    if relayout:
        if config.elastic:
            raise ConfigError(
                f"--resume cannot change --workers to a range (the run has {recorded.workers}); drop it, or start "
                "a new run with --init-from its checkpoint"
            )
        check_relayout(recorded_values, config)
    from distrain.orchestrator.tasks import load_task_object  # torch: only once the flags are checked

    load_task_object(config, path)  # a task object handed to distrain.fit: the very one, from task.pkl
    return config


def no_checkpoint(run_dir: Path) -> str:
    """The one line for a run directory with nothing to resume from (it ended before its first complete
    checkpoint: failed, diverged, or killed early)."""
    return (
        f"{run_dir} has no checkpoint to resume from; start the run again "
        "(with --checkpoint-steps N or --checkpoint-every N a run that stops can be resumed)"
    )


def _value(name: str, config: RunConfig) -> Any:
    """`config`'s value of `name` as a recorded config holds it (--workers: N or "MIN..MAX"; a strategy's
    option under its flat key, as to_dict writes it)."""
    return config.to_dict()[name]


def _same(name: str, recorded: Any, config: RunConfig) -> bool:
    """A recorded value equals `config`'s; --workers ranges compare as ranges ("2..4" == (2, 4))."""
    if name == "workers":
        try:
            return parse_workers(recorded) == (config.workers, config.max_workers)
        except ConfigError:
            return False
    return _plain(recorded) == _plain(_value(name, config))


def resume_checkpoint(config: RunConfig, num_params: int) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `config`'s run continues from: its newest, checked to belong to this run."""
    directory = Path(config.run_dir) / "checkpoints"
    path = latest_checkpoint(directory)
    if path is None:
        raise ConfigError(no_checkpoint(Path(config.run_dir)))
    payload = load_checkpoint_for(path, config.model, num_params)
    recorded = payload.get("config") or {}
    relayout = relayout_allowed(config) and "workers" in recorded and "batch_size" in recorded
    if relayout:
        check_relayout(recorded, config)
    for name in IDENTITY:
        if relayout and name in LAYOUT_FIELDS:
            continue
        if not _same(name, recorded.get(name), config):
            raise DistrainError(
                f"checkpoint {str(path)!r} was written by another run ({name} {recorded.get(name)!r}, "
                f"this run has {_value(name, config)!r}); it cannot be resumed here"
            )
    # config.yaml is a file a user can edit: every setting that changes the training math must still be
    # the one the checkpoint was trained with (settings a later version added are not in old checkpoints).
    if recorded.get("optimizer") in LEGACY_MOMENTUM[1] and recorded.get("momentum") == LEGACY_MOMENTUM[0]:
        recorded = recorded | {"momentum": None}  # recorded before momentum became sgd's (never read)
    current = config.to_dict()
    for name in RunConfig.field_names():
        if name in RESUMABLE or name in ("run_dir", "init_from") or name not in recorded:
            continue
        if relayout and name in LAYOUT_FIELDS:
            continue
        if name not in current:  # an option of a strategy this run does not use (older files record them all)
            continue
        if not _same(name, recorded[name], config):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"--resume cannot change {flag} (the run's checkpoint has {recorded[name]!r}, its config.yaml "
                f"now has {_value(name, config)!r}); put it back in {config.run_dir}/config.yaml, or start a "
                "new run with --init-from its checkpoint"
            )
    step, total = int(payload["global_step"]), total_steps(config)
    if step >= total:
        raise ConfigError(
            f"{config.run_dir!r} is finished (its checkpoint is at step {step} of {total}); nothing to resume. "
            "To train it further, raise --epochs or --max-steps"
        )
    # A sharded run's checkpoint: a sharded run reads its shards on its workers, any other layout whole.
    return path, payload if config.sharded else whole_checkpoint(payload, path)


def total_steps(config: RunConfig) -> int:
    """Global steps `config` trains for, from the data set's size (known without loading it)."""
    return run_steps(config.epochs, steps_per_epoch(config), config.max_steps)


def steps_per_epoch(config: RunConfig) -> int:
    if config.task:  # a user's task: its training set's size is known once the task is built
        from distrain.orchestrator.tasks import train_size

        return train_size(config) // config.samples_per_step
    return train_part_size(DATASETS.get(config.dataset).train_size, config.val_fraction) // config.samples_per_step


def recorded_rows(config: RunConfig, checkpoint: dict[str, Any]) -> dict[str, list[Any]]:
    """The metrics rows of the steps before `checkpoint`'s (and of the epochs evaluated by then), as a
    resumed run starts with them: from the run's metrics.parquet, written before each checkpoint.
    Checkpoints of earlier versions carried the rows themselves; those are taken as they are."""
    if "metrics" in checkpoint:
        return checkpoint["metrics"] or {}
    path = Path(config.run_dir) / "metrics.parquet"
    try:
        table = pq.read_table(path)
        # The base columns, the strategies' own step columns, and the task's own evaluation metrics and
        # logged scalars (test_<name>, train_<name>: orchestrator/metrics.py).
        impls = [s.implementation(config) for s in config.strategy_classes]
        declared = {n: t for s in impls for n, t in s.metric_columns.items() if n not in SCHEMA.names}
        extra = [pa.field(n, pa.type_for_alias(t)) for n, t in declared.items() if n in table.schema.names]
        added = (*EVAL_PREFIXES, LOGGED_PREFIX)  # the columns a run widens its schema with
        names = [n for n in table.schema.names if n.startswith(added) and n not in SCHEMA.names]
        extra += [pa.field(n, pa.float64()) for n in names]
        # A base column added since the file was written is left out here and null in the rows
        # (MetricsSink.add_rows); any other column missing makes the file unreadable.
        absent = {n for n in ADDED_COLUMNS if n not in table.schema.names}
        schema = pa.schema([f for f in list(SCHEMA) + extra if f.name not in absent])
        table = table.select(schema.names).cast(schema)
    except (OSError, KeyError, ValueError, pa.ArrowException):
        raise DistrainError(
            f"{str(path)!r} is missing or unreadable, so the metrics before step {checkpoint['global_step']} "
            "cannot be carried on; start a new run with --init-from the run's checkpoint"
        ) from None
    sink = MetricsSink(Path(config.run_dir).name)
    for strategy in config.strategy_classes:
        sink.declare(strategy.implementation(config).metric_columns)
    sink.add_rows(table.to_pydict())
    sink.keep_before(int(checkpoint["global_step"]), steps_per_epoch(config))
    return sink.rows()


def _plain(value: Any) -> Any:
    """Tuples and lists compare equal (YAML and torch.save keep sequences differently)."""
    return list(value) if isinstance(value, tuple | list) else value
