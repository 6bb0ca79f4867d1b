"""`RunConfig`: the one typed, validated description of a run.

It is built once (CLI flags over an optional YAML file over these defaults), validated here, and is
the only thing passed down to the orchestrator, strategies and trainers. Every field's help text lives
in its metadata, so the CLI, the YAML file and the docs describe a field in the same words.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distrain.errors import ConfigError

LR_SCALING_RULES = ("linear", "sqrt", "none")
STRATEGY_DEPENDENT_FIELDS = (
    "transport", "ps_shards", "staleness", "staleness_lr", "backup_workers", "backup_tasks", "portions",
    "tau", "adaptive_tau", "tau_interval", "tau_max", "schedule",
)  # fmt: skip
DEFAULT_TAU = 8
# AdaComm defaults: re-choose τ ten times a run whatever its length (a wall-clock interval can outlast a
# short run), and let τ rise to twice τ_0 (the rule's ratio exceeds 1 when the loss rises or the rate decays).
DEFAULT_TAU_INTERVAL = "10%"
DEFAULT_TAU_MAX_FACTOR = 2
LR_DECAYS = ("none", "cosine", "step")
# Set for one optimizer (one decay): a new --optimizer (--lr-decay) flag over a config file starts from
# its own defaults.
OPTIMIZER_DEPENDENT_FIELDS = ("momentum", "optimizer_args")
DECAY_DEPENDENT_FIELDS = ("lr_min", "lr_decay_epochs", "lr_decay_gamma")
ON_NONFINITE = ("stop", "skip")
PLACEMENTS = ("pack", "spread")
# Before --momentum became the choice of optimizers that read it, every run recorded its 0.9 default;
# recorded adam/adagrad runs with that value still load (config.yaml starts with RECORDED_HEADER).
LEGACY_MOMENTUM = (0.9, ("adam", "adagrad"))

# The first line of every config.yaml distrain writes (runs, sweeps' best.yaml).
RECORDED_HEADER = "# distrain run configuration: `distrain run --config THIS_FILE` repeats the run."


SECTIONS = ("resources", "data", "optimizer", "strategy", "checkpointing", "faults", "stragglers", "output")


def _f(default: Any, help: str, section: str | None = None, shown: str | None = None, flag: str = "") -> Any:
    """A config field: its help text, its section (the CLI's help panel), and the default as `--help`
    shows it when the value itself says little (an empty string); None-valued fields, resolved per
    strategy, state their effective default in the help text instead."""
    # `flag`: the CLI's name when it is not --<field-name> (--task-arg, --optimizer-arg: one value per use).
    return field(default=default, metadata={"help": help, "section": section, "shown": shown, "flag": flag})


def _coerce(kind: str, value: Any, flag: str) -> Any:
    """Check (and gently convert) one value against its field's annotation."""
    if kind.endswith(" | None"):
        return None if value is None else _coerce(kind.removesuffix(" | None"), value, flag)
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, str):  # YAML 1.1 reads `lr: 1e-3` as the string '1e-3'
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{flag} must be a number, got {value!r}")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} must be true or false, got {value!r}")
        return value
    if kind == "str":
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{flag} must be a string, got {value!r}")
        return value
    if kind == "dict[str, Any]":
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{flag} must be a mapping of names to values, got {value!r}")
        return dict(value)
    if kind == "list[str]":
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{flag} must be a list of strings, got {value!r}")
        return list(value)
    raise TypeError(f"unsupported config field type {kind}")


def parse_optimizer_args(specs: list[str]) -> dict[str, Any]:
    """["KEY=VALUE", ...] (--optimizer-arg) -> {key: value}, each value read as YAML (0.9, [0.9, 0.99], true)."""
    args: dict[str, Any] = {}
    for spec in specs:
        key, sep, text = spec.partition("=")
        key = key.strip()
        try:
            value = yaml.safe_load(text) if sep else None
        except yaml.YAMLError:
            sep = ""
        if not sep or not key.isidentifier() or text.strip() == "":
            raise ConfigError(f"--optimizer-arg {spec!r} must be KEY=VALUE, e.g. betas=[0.9,0.99] or nesterov=true")
        args[key] = value
    return args


def parse_stragglers(specs: list[str], workers: int) -> dict[int, float]:
    """["RANK:SECONDS", ...] -> {rank: seconds added to each of that worker's steps}."""
    delays: dict[int, float] = {}
    for spec in specs:
        rank_text, sep, seconds_text = spec.partition(":")
        try:
            rank, seconds = int(rank_text), float(seconds_text)
        except ValueError:
            rank, seconds = -1, -1.0
        if not sep or not 0 <= rank < workers or not (seconds >= 0 and math.isfinite(seconds)):
            raise ConfigError(f"--straggler {spec!r} must be RANK:SECONDS with 0 <= RANK < {workers} and SECONDS >= 0")
        delays[rank] = seconds
    return delays


TARGET_SYNTAX = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=)\s*(\S+)\s*$")


@dataclass(frozen=True)
class Target:
    """A quality target: the first evaluation at which `metric op value` holds is its time to target."""

    metric: str  # an evaluation column, e.g. test_accuracy, test_loss, test_perplexity
    op: str  # ">=" or "<="
    value: float

    def reached(self, x: float | None) -> bool:
        if x is None or math.isnan(x):
            return False
        return x >= self.value if self.op == ">=" else x <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


def parse_target(text: str) -> Target:
    """"test_accuracy>=0.95", "loss<=0.3" (metric names get the test_ prefix of the metrics file)."""
    match = TARGET_SYNTAX.match(text)
    value = math.nan
    if match:
        try:
            value = float(match.group(3))
        except ValueError:
            pass
    if not match or not math.isfinite(value):
        raise ConfigError(f"--target {text!r} must be METRIC>=VALUE or METRIC<=VALUE, e.g. test_accuracy>=0.95")
    metric = match.group(1) if match.group(1).startswith("test_") else f"test_{match.group(1)}"
    return Target(metric, match.group(2), value)


CHAOS_KINDS = ("kill-worker", "kill-ps", "hang-worker", "kill-node")


@dataclass(frozen=True)
class ChaosEvent:
    """One injected fault: `kind` at global step `step`, on worker/shard `target` (None: the default one)."""

    kind: str
    step: int
    target: int | None


def parse_chaos(specs: list[str], workers: int, ps_shards: int | None) -> list[ChaosEvent]:
    """["kill-worker@STEP[:RANK]", "kill-ps@STEP[:SHARD]", ...] -> events sorted by step."""
    events = []
    for spec in specs:
        kind, _, rest = spec.partition("@")
        step_text, sep, target_text = rest.partition(":")
        try:
            step, target = int(step_text), (int(target_text) if sep else None)
        except ValueError:
            step, target = -1, None
        if kind not in CHAOS_KINDS or step < 1 or (target is not None and target < 0):
            raise ConfigError(
                f"--chaos {spec!r} must be KIND@STEP[:TARGET] with STEP >= 1, KIND one of: {', '.join(CHAOS_KINDS)}"
            )
        if kind == "kill-ps" and ps_shards is None:
            raise ConfigError(f"--chaos {spec!r} needs the parameter-server transport; add --transport ps")
        limit = ps_shards if kind == "kill-ps" else workers
        if kind == "kill-node" and target is not None:
            raise ConfigError(f"--chaos {spec!r}: kill-node takes no target; write kill-node@STEP")
        if target is not None and target >= (limit or 0):
            raise ConfigError(f"--chaos {spec!r}: target {target} does not exist (0 <= TARGET < {limit})")
        events.append(ChaosEvent(kind, step, target))
    return sorted(events, key=lambda e: e.step)


def overlay(values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`given` over `values` (flags over a file, a trial's values over a sweep's base).

    What `values` resolved for its own strategy or optimizer (transport, strategy parameters,
    momentum) was resolved for that choice; a different one given here starts from its own
    defaults unless those fields are given too. A data set that reads no files drops the old
    --data-dir; one that does keeps it (mnist and cifar10 may well share a directory)."""
    merged = dict(values)
    given = dict(given)
    if "strategy" in given and given["strategy"] != merged.get("strategy", given["strategy"]):
        for name in STRATEGY_DEPENDENT_FIELDS:
            merged.pop(name, None)
    if "optimizer" in given and str(given["optimizer"]).lower() != str(merged.get("optimizer", "sgd")).lower():
        for name in OPTIMIZER_DEPENDENT_FIELDS:  # momentum and constructor arguments were the old optimizer's
            merged.pop(name, None)
    elif isinstance(merged.get("optimizer_args"), dict) and isinstance(given.get("optimizer_args"), dict):
        given["optimizer_args"] = merged["optimizer_args"] | given["optimizer_args"]  # flags add to the file's
    if "lr_decay" in given and given["lr_decay"] != merged.get("lr_decay", "none"):
        for name in DECAY_DEPENDENT_FIELDS:
            merged.pop(name, None)
    if given.get("dataset", merged.get("dataset")) != merged.get("dataset"):
        from distrain.trainers.datasets import DATASETS

        if given["dataset"] in DATASETS and not DATASETS.get(given["dataset"]).reads_files:
            merged.pop("data_dir", None)
    merged.update(given)
    return merged


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is refused: PyYAML keeps the last
    one silently, so `workers: 2` further down a file would quietly undo an earlier `workers: 8`."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` merges; it is not a key
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the base class reports it as malformed YAML
                continue
        return super().construct_mapping(node, deep=deep)


@dataclass
class RunConfig:
    # --- what runs where ---
    strategy: str = _f("bsp", "Consistency strategy (see `distrain strategies`).", "strategy")
    workers: int = _f(2, "Number of data-parallel worker actors.", "resources")
    cpus_per_worker: float = _f(1.0, "CPUs reserved for each worker actor (also its torch thread count).", "resources")
    gpus_per_worker: float = _f(0.0, "GPUs per worker actor; > 0 switches the collective to NCCL.", "resources")
    address: str = _f(
        "", "Ray address: empty starts a local Ray; 'auto' or host:port connects to a cluster.", "resources", "local"
    )
    placement: str = _f(
        "pack",
        "Worker placement: pack (fewest nodes) or spread (across nodes); PS shards go where workers are fewest.",
        "resources",
    )
    transport: str = _f(
        "",
        "collective (all-reduce) or ps (parameter server); empty: the strategy's default (ps for async and ssp, "
        "collective for bsp and local-sgd).",
        "strategy",
        "per strategy",
    )
    ps_shards: int | None = _f(
        None, "Parameter-server shards K; default 1 (async, ssp, bsp --transport ps).", "strategy"
    )
    cpus_per_shard: float = _f(1.0, "CPUs reserved for each parameter-server shard actor.", "resources")
    staleness: int | None = _f(
        None, "SSP staleness bound s: no worker runs more than s clocks ahead; default 2 (ssp).", "strategy"
    )
    staleness_lr: bool = _f(
        False, "Divide the rate by a gradient's staleness (async, ssp; Zhang et al. 2016).", "strategy"
    )
    tau: int | None = _f(
        None, "Local steps between parameter averages (adaptive: tau_0); default 8 (local-sgd).", "strategy"
    )
    adaptive_tau: bool = _f(False, "Re-choose tau every --tau-interval from the loss (AdaComm; local-sgd).", "strategy")
    tau_interval: str | None = _f(
        None,
        "AdaComm interval: seconds like 5s, local steps like 200, or a share of the run's steps like 10%; "
        "default 10% (local-sgd --adaptive-tau).",
        "strategy",
    )
    tau_max: int | None = _f(
        None, "AdaComm: largest tau it may choose; default 2 x --tau (local-sgd --adaptive-tau).", "strategy"
    )
    schedule: str = _f(
        "", "Strategies in sequence, switching at epoch marks: name[:epochs],... e.g. bsp:2,local-sgd.", "strategy"
    )
    comm_delay_ms: float = _f(
        0.0, "Emulated network delay added to every communication round, ms (experiments).", "strategy"
    )
    straggler: list[str] = _f(
        (), "RANK:SECONDS adds that delay to every step of that worker (repeatable; for experiments).", "stragglers"
    )
    backup_workers: int = _f(
        0,
        "k-of-n BSP (bsp over ps): start b extra workers; each round applies the first --workers gradients.",
        "stragglers",
    )
    backup_tasks: bool = _f(
        False,
        "BSP over ps: split each round into --portions, re-issue the last outstanding ones to idle workers.",
        "stragglers",
    )
    portions: int | None = _f(
        None, "Portions per round; default 2 x --workers (bsp --transport ps --backup-tasks).", "stragglers"
    )
    straggler_threshold: float = _f(
        2.0,
        "Flag a worker as a straggler when its recent median compute time is this many times the others'.",
        "stragglers",
    )
    # --- what is trained ---
    task: str = _f(
        "",
        "What is trained: the built-in image classification (--model on --dataset), or your own "
        "distrain.Task as module:Name or path/to/file.py:Name.",
        "data",
        "built-in classification",
    )
    task_args: dict[str, Any] = _f(
        None,
        "Keyword arguments of the task's constructor, KEY=VALUE with the value in YAML (repeatable).",
        "data",
        "none",
        flag="--task-arg",
    )
    prefetch: bool = _f(
        True, "Read each worker's next batch on a background thread while the current one trains.", "data"
    )
    model: str = _f("cnn", "Model: mlp, cnn or resnet18 (torchvision, adapted to small images).", "data")
    dataset: str = _f("digits", "Data set: digits (bundled), mnist, cifar10 (from --data-dir), synthetic.", "data")
    data_dir: str = _f("", "Directory holding torchvision's MNIST/ or cifar-10-batches-py/ files.", "data")
    # --- optimisation ---
    batch_size: int = _f(32, "Per-worker batch size B; the global batch is workers x B.", "optimizer")
    lr: float = _f(0.05, "Base learning rate, defined for --base-batch-size samples per step.", "optimizer")
    lr_scaling: str = _f("linear", "Scale lr with the global batch: linear, sqrt or none (Goyal et al.).", "optimizer")
    base_batch_size: int = _f(64, "Global batch size at which --lr applies unscaled.", "optimizer")
    warmup_epochs: float = _f(0.0, "Epochs of gradual warmup from --lr to the scaled rate (0: none).", "optimizer")
    lr_decay: str = _f("none", "After warmup: none (constant), cosine (to --lr-min) or step.", "optimizer")
    lr_min: float | None = _f(
        None, "Cosine decay: the rate it falls to by the end of the run; default 0 (--lr-decay cosine).", "optimizer"
    )
    lr_decay_epochs: float | None = _f(
        None, "Step decay: epochs between drops, counted from the end of warmup (--lr-decay step).", "optimizer"
    )
    lr_decay_gamma: float | None = _f(
        None, "Step decay: each drop multiplies the rate by this; default 0.1 (--lr-decay step).", "optimizer"
    )
    optimizer: str = _f(
        "sgd",
        "Optimizer (any case): sgd, adam, adamw, adagrad, rmsprop, adamax, nadam, radam, adadelta, asgd, rprop.",
        "optimizer",
    )
    optimizer_args: dict[str, Any] = _f(
        None,
        "Further arguments of the optimizer's constructor, KEY=VALUE with the value in YAML (repeatable), "
        "e.g. betas=[0.9,0.95] or nesterov=true.",
        "optimizer",
        "none",
        flag="--optimizer-arg",
    )
    momentum: float | None = _f(
        None, "Momentum (sgd, rmsprop); default 0.9 for sgd, 0 for rmsprop; other optimizers refuse it.", "optimizer"
    )
    weight_decay: float | None = _f(
        None,
        "Weight decay (adamw: decoupled); default the optimizer's own: 0, adamw 0.01; rprop refuses it.",
        "optimizer",
    )
    epochs: int = _f(12, "Passes over the training set.", "data")
    max_steps: int = _f(0, "Stop after this many global steps (0: no limit beyond --epochs).", "data")
    seed: int = _f(0, "Seeds model init and data order; equal seeds give equal runs on one transport.", "data")
    # --- recording ---
    target: str = _f(
        "",
        "Quality target METRIC>=VALUE or METRIC<=VALUE (e.g. test_loss<=0.5) whose first crossing is reported "
        "as time to target.",
        "output",
        "the task's own (classification: test_accuracy>=--target-accuracy)",
    )
    target_accuracy: float = _f(0.95, "Test accuracy whose first crossing is reported as time-to-accuracy.", "output")
    run_dir: str = _f("", "Run directory; must be new or empty.", "output", "runs/<timestamp>-<strategy>")
    eval_every: int = _f(1, "Evaluate on the held-out split every N epochs (0: only at the end).", "output")
    tensorboard: str = _f(
        "", "Write TensorBoard event files (training loss, lr, samples/s, test metrics) under DIR/<run id>/.", "output"
    )
    checkpoint_every: int = _f(0, "Also checkpoint every N epochs (0: only at the end).", "checkpointing")
    segment_steps: int = _f(
        20,
        "Steps a worker runs per remote call (the driver is off the per-step path); rows, and the progress "
        "display, advance a segment at a time.",
        "resources",
    )
    collective_timeout_s: float = _f(300.0, "Timeout for collective operations and rendezvous, seconds.", "faults")
    init_from: str = _f(
        "", "Start from this checkpoint (model, optimizer, step), whatever strategy wrote it.", "checkpointing"
    )
    # --- fault tolerance (orchestrator/recovery.py, orchestrator/chaos.py) ---
    checkpoint_steps: int = _f(
        0, "Also checkpoint every N global steps (0: off); recovery restarts from the latest.", "checkpointing"
    )
    max_failures: int = _f(
        3, "Failures (dead or hung workers/shards) to recover from before giving up (-1: no limit).", "faults"
    )
    hang_timeout_s: float = _f(
        300.0, "A worker or parameter-server wait silent this long is treated as dead, seconds.", "faults"
    )
    chaos: list[str] = _f(
        (),
        "Fault injection: kill-worker@STEP[:RANK], kill-ps@STEP[:SHARD], hang-worker@STEP[:RANK], kill-node@STEP.",
        "faults",
    )
    on_nonfinite: str = _f(
        "stop",
        "A non-finite loss or gradient: stop (status diverged, exit code 3, no checkpoint written) or skip "
        "that update (counted as nonfinite_steps in the summary).",
        "faults",
    )

    def __post_init__(self) -> None:
        self._coerce_types()
        self.validate()

    # ------------------------------------------------------------------ validation
    def _coerce_types(self) -> None:
        for f in dataclasses.fields(self):
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            setattr(self, f.name, _coerce(kind, getattr(self, f.name), "--" + f.name.replace("_", "-")))

    def validate(self) -> None:
        """Check every value; the message of the first problem names the flag and the fix."""
        from distrain.strategies import STRATEGIES
        from distrain.trainers.datasets import DATASETS
        from distrain.trainers.models import MODELS

        if self.schedule:
            if self.epochs < 1:
                raise ConfigError(f"--epochs must be >= 1, got {self.epochs}")
            from distrain.strategies.phases import parse_schedule

            # The first entry is the run's strategy (and names the run directory).
            self.strategy = parse_schedule(self.schedule, self.epochs)[0].strategy
        strategy = STRATEGIES.get(self.strategy)
        MODELS.check(self.model)
        DATASETS.check(self.dataset)
        self._validate_strategy_fields(strategy)
        positive_ints = ("workers", "batch_size", "base_batch_size", "epochs", "segment_steps")
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "checkpoint_every", "checkpoint_steps", "eval_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "cpus_per_worker", "cpus_per_shard", "collective_timeout_s", "hang_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        self._validate_unused_inputs()
        for name in ("gpus_per_worker", "momentum", "weight_decay", "warmup_epochs", "comm_delay_ms"):
            value = getattr(self, name)
            if value is None:  # momentum of an optimizer without one
                continue
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if not 0 <= self.seed < 2**64:  # numpy's default_rng refuses negative seeds, torch's > 64 bits
            raise ConfigError(f"--seed must be in [0, 2**64), got {self.seed}")
        if self.momentum is not None and self.momentum >= 1:
            raise ConfigError(f"--momentum must be < 1, got {self.momentum}")
        if self.warmup_epochs > self.epochs:
            raise ConfigError(f"--warmup-epochs ({self.warmup_epochs}) exceeds --epochs ({self.epochs}); lower it")
        self._validate_backups()
        parse_stragglers(self.straggler, self.num_worker_actors)
        if not (self.straggler_threshold > 1 and math.isfinite(self.straggler_threshold)):
            raise ConfigError(f"--straggler-threshold must be a number > 1, got {self.straggler_threshold}")
        if self.max_failures < -1:
            raise ConfigError(f"--max-failures must be >= 0, or -1 for no limit; got {self.max_failures}")
        parse_chaos(self.chaos, self.num_worker_actors, self.ps_shards)
        if self.init_from and not Path(self.init_from).is_file():
            raise ConfigError(f"--init-from {self.init_from!r} is not a file; pass a checkpoint (.pt) path")
        if not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.target:
            parse_target(self.target)
        self._validate_task()
        if self.lr_scaling not in LR_SCALING_RULES:
            raise ConfigError(f"unknown --lr-scaling {self.lr_scaling!r}; choose one of: {', '.join(LR_SCALING_RULES)}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"unknown --placement {self.placement!r}; choose one of: {', '.join(PLACEMENTS)}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"unknown --on-nonfinite {self.on_nonfinite!r}; choose one of: {', '.join(ON_NONFINITE)}")
        self._validate_optimizer()
        self._validate_lr_decay()

    def _validate_optimizer(self) -> None:
        from distrain.trainers.optim_state import check_optimizer  # imports torch: only when validating

        self.optimizer = check_optimizer(self.optimizer, self.optimizer_args, self.momentum, self.weight_decay)

    def _validate_lr_decay(self) -> None:
        if self.lr_decay not in LR_DECAYS:
            raise ConfigError(f"unknown --lr-decay {self.lr_decay!r}; choose one of: {', '.join(LR_DECAYS)}")
        owners = {"lr_min": "cosine", "lr_decay_epochs": "step", "lr_decay_gamma": "step"}
        for name, decay in owners.items():
            if getattr(self, name) is not None and self.lr_decay != decay:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} applies to --lr-decay {decay}; add that or drop {flag}")
        if self.lr_decay == "cosine":
            from distrain.trainers.schedule import scaled_lr

            peak = scaled_lr(self.lr, self.global_batch_size, self.base_batch_size, self.lr_scaling)
            if self.lr_min is not None and not (0 <= self.lr_min < peak):
                raise ConfigError(f"--lr-min must be >= 0 and below the peak rate {peak:g}, got {self.lr_min}")
        if self.lr_decay == "step":
            if self.lr_decay_epochs is None:
                raise ConfigError("--lr-decay step needs --lr-decay-epochs E: the rate drops every E epochs")
            if not (self.lr_decay_epochs > 0 and math.isfinite(self.lr_decay_epochs)):
                raise ConfigError(f"--lr-decay-epochs must be a positive number, got {self.lr_decay_epochs}")
            if self.lr_decay_gamma is not None and not 0 < self.lr_decay_gamma <= 1:
                raise ConfigError(f"--lr-decay-gamma must be in (0, 1], got {self.lr_decay_gamma}")

    def _validate_task(self) -> None:
        """A task path must look like one; the built-in task's own flags do not apply to another task."""
        from distrain.plugins import split_import_path

        if not self.task:
            if self.task_args:
                raise ConfigError("--task-arg applies to a --task of your own; the built-in task takes --model etc.")
            return
        from distrain.plugins import absolute_import_path

        if self.task.startswith("object:"):  # a task object handed to distrain.fit (orchestrator/tasks.py)
            return
        split_import_path(self.task, "--task")
        # Recorded absolute, so Tune trials (own working directories) and --config repeats load the same file.
        self.task = absolute_import_path(self.task, "--task")
        defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
        for name in ("model", "dataset", "data_dir", "target_accuracy"):
            if getattr(self, name) != defaults[name]:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{flag} applies to the built-in classification task, not --task {self.task}; "
                    "pass your task's settings with --task-arg key=value"
                    + (" and its target with --target" if name == "target_accuracy" else "")
                )

    @property
    def target_spec(self) -> Target | None:
        """The quality target given (--target, or --target-accuracy for the built-in task); None: the
        user task's own `default_target`, known once the task is loaded."""
        if self.target:
            return parse_target(self.target)
        if not self.task:
            return Target("test_accuracy", ">=", self.target_accuracy)
        return None

    def _validate_unused_inputs(self) -> None:
        """Like a strategy's parameters, --data-dir is refused where nothing reads it (--momentum and the
        other optimizer flags: `_validate_optimizer`)."""
        from distrain.trainers.datasets import DATASETS

        if self.data_dir and not DATASETS.get(self.dataset).reads_files:
            users = [n for n in DATASETS.names() if DATASETS.get(n).reads_files]
            raise ConfigError(
                f"--data-dir is not used by --dataset {self.dataset} (it reads no files); drop it "
                f"(it applies to: {', '.join(users)})"
            )

    def _validate_strategy_fields(self, strategy: Any) -> None:
        """Transport and strategy-specific flags must fit the chosen strategy."""
        from distrain.strategies.base import STRATEGY_FIELDS
        from distrain.strategies.registry import STRATEGIES

        if not self.transport:
            self.transport = strategy.transports[0]
        if self.transport not in ("collective", "ps"):
            raise ConfigError(f"unknown --transport {self.transport!r}; choose collective or ps")
        if self.transport not in strategy.transports:
            raise ConfigError(
                f"--transport {self.transport} cannot carry --strategy {self.strategy}; "
                f"it runs on: {', '.join(strategy.transports)}"
            )
        phases = [strategy]
        if self.schedule:
            from distrain.strategies.phases import parse_schedule

            if self.transport != strategy.transports[0]:
                raise ConfigError(
                    f"--transport {self.transport} cannot be combined with --schedule: each phase runs on its "
                    "strategy's default transport; drop --transport"
                )
            phases = [STRATEGIES.get(p.strategy) for p in parse_schedule(self.schedule, self.epochs)]
        reads = frozenset().union(*(s.reads for s in phases))
        user = f"--schedule {self.schedule}" if self.schedule else f"--strategy {self.strategy}"
        for name in STRATEGY_FIELDS:
            if getattr(self, name) not in (None, False) and name not in reads:
                users = [n for n in STRATEGIES.names() if name in STRATEGIES.get(n).reads]
                raise ConfigError(
                    f"--{name.replace('_', '-')} is not used by {user}; drop it (it applies to: {', '.join(users)})"
                )
        if "staleness" in reads and self.staleness is None:
            self.staleness = 2
        if self.staleness is not None and self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {self.staleness}")
        if "tau" in reads:
            self._validate_tau()
        if self.transport == "ps" or any(s.transports[0] == "ps" for s in phases):
            if self.ps_shards is None:
                self.ps_shards = 1
            if self.ps_shards < 1:
                raise ConfigError(f"--ps-shards must be >= 1, got {self.ps_shards}")
        elif self.ps_shards is not None:
            raise ConfigError("--ps-shards needs the parameter-server transport; add --transport ps or drop it")

    def _validate_backups(self) -> None:
        """Backup workers and backup tasks are ways of running BSP rounds on the parameter server."""
        if self.backup_workers < 0:
            raise ConfigError(f"--backup-workers must be >= 0, got {self.backup_workers}")
        flags = (("--backup-workers", self.backup_workers), ("--backup-tasks", self.backup_tasks))
        wanted = [name for name, on in flags if on]
        if wanted and self.schedule:
            raise ConfigError(f"{wanted[0]} cannot be combined with --schedule; drop one of them")
        if wanted and (self.strategy != "bsp" or self.transport != "ps"):
            raise ConfigError(
                f"{wanted[0]} needs synchronous rounds on the parameter server: use --strategy bsp --transport ps"
            )
        if len(wanted) == 2:
            raise ConfigError("--backup-workers and --backup-tasks are alternatives; choose one")
        if self.portions is not None and not self.backup_tasks:
            raise ConfigError("--portions splits rounds for --backup-tasks; add --backup-tasks or drop it")
        if self.backup_tasks:
            if self.portions is None:
                self.portions = 2 * self.workers
            if self.portions <= self.workers:
                raise ConfigError(
                    f"--portions ({self.portions}) must exceed --workers ({self.workers}) so free workers can take more"
                )
            if self.global_batch_size % self.portions:
                raise ConfigError(
                    f"--portions {self.portions} does not divide the global batch {self.global_batch_size} "
                    "(--workers x --batch-size) into equal portions"
                )

    def _validate_tau(self) -> None:
        from distrain.strategies.adacomm import TauInterval

        if self.tau is None:
            self.tau = DEFAULT_TAU
        if self.tau < 1:
            raise ConfigError(f"--tau must be >= 1, got {self.tau}")
        if self.tau_max is not None and self.tau_max < self.tau:
            raise ConfigError(f"--tau-max ({self.tau_max}) is below --tau ({self.tau}); raise it or drop it")
        if not self.adaptive_tau:
            for name in ("tau_interval", "tau_max"):
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise ConfigError(f"{flag} only applies with --adaptive-tau; add --adaptive-tau or drop {flag}")
            return
        if self.tau_interval is None:
            self.tau_interval = DEFAULT_TAU_INTERVAL
        TauInterval.parse(self.tau_interval)
        if self.tau_max is None:
            self.tau_max = DEFAULT_TAU_MAX_FACTOR * self.tau

    # ------------------------------------------------------------------ derived values
    @property
    def global_batch_size(self) -> int:
        """Samples whose gradients make one update (the learning rate is scaled for this)."""
        return self.workers * self.batch_size

    @property
    def num_worker_actors(self) -> int:
        """Worker actors started: --workers plus any backup workers."""
        return self.workers + self.backup_workers

    @property
    def samples_per_step(self) -> int:
        """Samples handed out per step: with backup workers, b x B more than the update uses."""
        return self.num_worker_actors * self.batch_size

    @property
    def straggler_delays(self) -> dict[int, float]:
        return parse_stragglers(self.straggler, self.num_worker_actors)

    @property
    def chaos_events(self) -> list[ChaosEvent]:
        return parse_chaos(self.chaos, self.workers, self.ps_shards)

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_worker > 0

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        lines = [RECORDED_HEADER]
        for f in dataclasses.fields(self):
            lines.append(f"# {f.metadata['help']}")
            lines.append(yaml.safe_dump({f.name: getattr(self, f.name)}, sort_keys=False).rstrip())
        return "\n".join(lines) + "\n"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "configuration") -> RunConfig:
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(unknown)} in {source}; valid keys: {', '.join(cls.field_names())}"
            )
        return cls(**values)

    @classmethod
    def load_yaml(cls, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read a YAML config file into a plain mapping (validated when merged into a RunConfig)."""
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a directory; pass a YAML file to --config")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found; pass an existing YAML file to --config")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(p)!r} is not a text (UTF-8 YAML) file; pass a YAML file") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror or e}") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except _DuplicateKey as e:
            lines = f"line {e.first}" if e.first == e.again else f"lines {e.first} and {e.again}"
            raise ConfigError(f"key {e.key!r} appears twice in {str(p)!r} ({lines}); keep one of them") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"malformed YAML in {str(p)!r}{where}; fix the file or drop --config") from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ConfigError(f"{str(p)!r} must hold a mapping of config keys, got {type(data).__name__}")
        if text.startswith(RECORDED_HEADER) and data.get("optimizer") in LEGACY_MOMENTUM[1]:
            # Runs recorded before momentum became sgd-only wrote its old default for every optimizer;
            # that value was never read, and must not stop `--config` or `--resume` of such a run.
            if data.get("momentum") == LEGACY_MOMENTUM[0]:
                data["momentum"] = None
        return data

    @classmethod
    def resolve(cls, config_file: str | None, overrides: dict[str, Any]) -> RunConfig:
        """Defaults, then the YAML file, then explicit flags (those not None)."""
        values: dict[str, Any] = {}
        source = "configuration"
        if config_file:
            values.update(cls.load_yaml(config_file))
            source = config_file
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(unknown)} in {source}; valid keys: {', '.join(cls.field_names())}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls.from_mapping(overlay(values, given), source)
