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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from distrain.errors import ConfigError
from distrain.fields import FieldInfo, coerce, fields_of, setting
from distrain.trainers.builtin_names import DATASET_READS_FILES, MODEL_NAMES

if TYPE_CHECKING:
    from distrain.strategies.base import Strategy

LR_SCALING_RULES = ("linear", "sqrt", "none")
# Set for one strategy: a new --strategy over a config file starts from its own defaults for these and
# for every strategy's own options (`strategy_dependent_fields`).
STRATEGY_COMMON_DEPENDENT = ("transport", "ps_shards", "schedule")
LR_DECAYS = ("none", "cosine", "step")
# Set for one optimizer (one decay): a new --optimizer (--lr-decay) flag over a config file starts from
# its own defaults.
OPTIMIZER_DEPENDENT_FIELDS = ("momentum", "optimizer_args")
DECAY_DEPENDENT_FIELDS = ("lr_min", "lr_decay_epochs", "lr_decay_gamma")
ON_NONFINITE = ("stop", "skip")
# --on-nonfinite skip: a run that skipped more than this share of its global steps as non-finite ends
# `diverged` (fp16 loss-scale overflows not counted; orchestrator/outcome.py applies the rule).
SKIPPED_SHARE_LIMIT = 0.10
# --precision: the forward pass under torch.autocast (trainers/precision.py); fp16 adds a loss scale.
PRECISIONS = ("fp32", "bf16", "fp16")
# The element-wise torch.optim optimizers, and the other torch.optim optimizers, which are refused with a
# reason (trainers/optim_state.py; tests hold these names to its lists and to torch's).
OPTIMIZER_NAMES = (
    "sgd",
    "adam",
    "adamw",
    "adagrad",
    "rmsprop",
    "adamax",
    "nadam",
    "radam",
    "adadelta",
    "asgd",
    "rprop",
)
REFUSED_OPTIMIZER_NAMES = ("lbfgs", "sparseadam", "adafactor", "muon")
PLACEMENTS = ("pack", "spread")
# Before --momentum became the choice of optimizers that read it, every run recorded its 0.9 default;
# recorded adam/adagrad runs with that value still load (config.yaml starts with RECORDED_HEADER).
LEGACY_MOMENTUM = (0.9, ("adam", "adagrad"))

# The options of the built-in classification task, which a user's --task does not read.
BUILTIN_TASK_FIELDS = ("model", "dataset", "data_dir", "target_accuracy")

# The first line of every config.yaml distrain writes (runs, sweeps' best.yaml).
RECORDED_HEADER = "# distrain run configuration: `distrain run --config THIS_FILE` repeats the run."


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


def _one_of(names: Any, last: str = "or") -> str:
    """ "a, b or c": the catalog's names as a help text lists them (trainers/builtin_names.py, without torch)."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


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
    """ "test_accuracy>=0.95", "loss<=0.3" (metric names get the test_ prefix of the metrics file)."""
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


WORKER_RANGE = re.compile(r"^\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")


def parse_workers(value: Any) -> tuple[int, int]:
    """--workers as (MIN, MAX): N -> (N, 0), a fixed size; "MIN..MAX" -> (MIN, MAX), an elastic range
    (MIN == MAX is a fixed size too). The CLI's string and YAML's int or string go through here alike."""
    if isinstance(value, tuple | list) and len(value) == 2:  # (min, max) as `worker_range` gives it
        low, high = int(value[0]), int(value[1])
        return parse_workers(f"{low}..{high}") if high else parse_workers(low)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    shape = f"--workers must be an integer, got {value!r} (or a range MIN..MAX, e.g. 2..4)"
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"--workers must be >= 1, got {value}")
        return value, 0
    text = str(value).strip() if isinstance(value, str) else ""
    if text.lstrip("-").isdigit():
        return parse_workers(int(text))
    match = WORKER_RANGE.match(text)
    if not match:
        raise ConfigError(shape)
    low, high = int(match.group(1)), int(match.group(2))
    if low < 1:
        raise ConfigError(f"--workers {text}: MIN must be >= 1, got {low}")
    if low > high:
        raise ConfigError(f"--workers {text}: MIN ({low}) is above MAX ({high}); write MIN..MAX with MIN <= MAX")
    return low, (high if high > low else 0)


def format_workers(workers: int, max_workers: int) -> int | str:
    """How --workers is written back (config.yaml, summaries): N, or "MIN..MAX"."""
    return f"{workers}..{max_workers}" if max_workers else workers


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
        for name in strategy_dependent_fields():
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
        from distrain.trainers.builtin_names import DATASET_READS_FILES

        if DATASET_READS_FILES.get(given["dataset"]) is False:
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


@dataclass(frozen=True)
class Resources:
    """What runs where: workers, their CPUs and GPUs, the Ray cluster."""

    workers: int = setting(
        2,
        "Data-parallel worker actors: N (fixed), or MIN..MAX (elastic: starts once MIN can be placed, grows "
        "towards MAX as the cluster has room, shrinks when a worker or node is lost; --strategy async, ssp, "
        "bsp (either transport), local-sgd or diloco; under bsp, local-sgd and diloco a round is then N'xB "
        "samples at --lr-scaling's rate for it).",
        "resources",
        metavar="N|MIN..MAX",
    )
    max_workers: int = setting(
        0, "The MAX of an elastic --workers MIN..MAX (0: a fixed size).", "resources", derived=True
    )
    cpus_per_worker: float = setting(
        1.0, "CPUs reserved for each worker actor (also its torch thread count).", "resources"
    )
    gpus_per_worker: float = setting(0.0, "GPUs per worker actor; > 0 switches the collective to NCCL.", "resources")
    address: str = setting(
        "", "Ray address: empty starts a local Ray; 'auto' or host:port connects to a cluster.", "resources", "local"
    )
    placement: str = setting(
        "pack",
        "Worker placement: pack (fewest nodes) or spread (across nodes); PS shards go where workers are fewest. "
        "A pipeline's replicas spread regardless, each replica's stages on one node.",
        "resources",
    )
    cpus_per_shard: float = setting(1.0, "CPUs reserved for each parameter-server shard actor.", "resources")
    worker_memory: str = setting(
        "",
        "A worker's memory budget for its training state (parameters, gradients, optimizer state, activations), "
        "e.g. 3GiB: a run whose largest worker would hold more is refused, naming the --pipeline-stages that fit.",
        "resources",
        metavar="BYTES",
    )
    segment_steps: int = setting(
        20,
        "Steps a worker runs per remote call (the driver is off the per-step path); rows, and the progress "
        "display, advance a segment at a time.",
        "resources",
    )


@dataclass(frozen=True)
class Data:
    """What is trained, on which data, for how long."""

    task: str = setting(
        "",
        "What is trained: the built-in image classification (--model on --dataset), or your own "
        "distrain.Task as module:Name or path/to/file.py:Name.",
        "data",
        "built-in classification",
    )
    task_args: dict[str, Any] = setting(
        None,
        "Keyword arguments of the task's constructor, KEY=VALUE with the value in YAML (repeatable).",
        "data",
        "none",
        flag="--task-arg",
        metavar="KEY=VALUE",
    )
    prefetch: bool = setting(
        True, "Read each worker's next batch on a background thread while the current one trains.", "data"
    )
    model: str = setting("cnn", f"Built-in model: {_one_of(MODEL_NAMES)}.", "data")
    dataset: str = setting(
        "digits",
        f"Built-in data set: {_one_of(DATASET_READS_FILES)}; "
        f"{_one_of([n for n, reads in DATASET_READS_FILES.items() if reads], 'and')} are read from --data-dir, "
        "the others are bundled or generated.",
        "data",
    )
    data_dir: str = setting("", "Directory holding torchvision's MNIST/ or cifar-10-batches-py/ files.", "data")
    epochs: int = setting(12, "Passes over the training set.", "data")
    max_steps: int = setting(0, "Stop after this many global steps (0: no limit beyond --epochs).", "data")
    seed: int = setting(0, "Seeds model init and data order; equal seeds give equal runs on one transport.", "data")


@dataclass(frozen=True)
class Optimization:
    """The optimizer, its learning rate, its schedule, and the batch it is scaled for."""

    batch_size: int = setting(32, "Per-worker batch size B; the global batch is workers x B.", "optimizer")
    lr: float = setting(
        0.05,
        "Base learning rate, defined for --base-batch-size samples per step (diloco: the inner rate, default 0.01).",
        "optimizer",
    )
    lr_scaling: str = setting(
        "linear", "Scale lr with the global batch: linear, sqrt or none (Goyal et al.).", "optimizer"
    )
    base_batch_size: int = setting(64, "Global batch size at which --lr applies unscaled.", "optimizer")
    warmup_epochs: float = setting(0.0, "Epochs of gradual warmup from --lr to the scaled rate (0: none).", "optimizer")
    lr_decay: str = setting("none", "After warmup: none (constant), cosine (to --lr-min) or step.", "optimizer")
    lr_min: float | None = setting(
        None, "Cosine decay: the rate it falls to by the end of the run; default 0 (--lr-decay cosine).", "optimizer"
    )
    lr_decay_epochs: float | None = setting(
        None, "Step decay: epochs between drops, counted from the end of warmup (--lr-decay step).", "optimizer"
    )
    lr_decay_gamma: float | None = setting(
        None, "Step decay: each drop multiplies the rate by this; default 0.1 (--lr-decay step).", "optimizer"
    )
    optimizer: str = setting(
        "sgd",
        "Optimizer (any case): sgd, adam, adamw, adagrad, rmsprop, adamax, nadam, radam, adadelta, asgd, rprop.",
        "optimizer",
    )
    optimizer_args: dict[str, Any] = setting(
        None,
        "Further arguments of the optimizer's constructor, KEY=VALUE with the value in YAML (repeatable), "
        "e.g. betas=[0.9,0.95] or nesterov=true.",
        "optimizer",
        "none",
        flag="--optimizer-arg",
        metavar="KEY=VALUE",
    )
    momentum: float | None = setting(
        None, "Momentum (sgd, rmsprop); default 0.9 for sgd, 0 for rmsprop; other optimizers refuse it.", "optimizer"
    )
    weight_decay: float | None = setting(
        None,
        "Weight decay (adamw: decoupled); default the optimizer's own: 0, adamw 0.01; rprop refuses it.",
        "optimizer",
    )
    precision: str = setting(
        "fp32",
        "Forward pass dtype: fp32, bf16 or fp16 (torch.autocast; parameters, gradients, optimizer state and "
        "traffic stay float32; fp16 adds a dynamic loss scale, checkpointed). Not --compress bf16, which "
        "changes only what travels.",
        "optimizer",
    )


@dataclass(frozen=True)
class StrategySection:
    """The consistency strategy, its transport, a schedule of strategies, and each strategy's own options."""

    strategy: str = setting(
        "bsp", "Consistency strategy (see `distrain strategies`), or auto: what `distrain plan` recommends.", "strategy"
    )
    transport: str = setting(
        "",
        "collective (all-reduce) or ps (parameter server); empty: the strategy's default (ps for async and ssp, "
        "collective for bsp and local-sgd).",
        "strategy",
        "per strategy",
    )
    ps_shards: int | None = setting(
        None, "Parameter-server shards K; default 1 (async, ssp, bsp --transport ps).", "strategy"
    )
    schedule: str = setting(
        "", "Strategies in sequence, switching at epoch marks: name[:epochs],... e.g. bsp:2,local-sgd.", "strategy"
    )
    comm_delay_ms: float = setting(
        0.0, "Emulated network latency: every transfer takes at least this long, ms (experiments).", "strategy"
    )
    comm_bandwidth: str | None = setting(
        None,
        "Emulated link bandwidth per worker, e.g. 100mbit, 25gbit, 12.5MB/s: every transfer takes at least "
        "--comm-delay-ms + bytes / RATE (experiments).",
        "strategy",
        metavar="RATE",
    )
    compress: str | None = setting(
        None,
        "Compress the strategy's traffic: fp16, bf16, int8, topk:FRACTION or powersgd:RANK (the last three with "
        "error feedback); gradients under bsp, pushes on the parameter server, theta's change under local-sgd, "
        "pseudo-gradients under diloco.",
        "strategy",
        metavar="CODEC",
    )
    pipeline_stages: int = setting(
        1,
        "Pipeline (model) parallelism: cut the model into S stages, one actor each; --workers R replicas of the "
        "pipeline make S x R actors (actor rank = replica x S + stage).",
        "strategy",
        metavar="S",
    )
    microbatches: int = setting(
        1,
        "Micro-batches M each replica's batch is cut into, with --pipeline-stages (M divides --batch-size).",
        "strategy",
        metavar="M",
    )
    pipeline_schedule: str = setting(
        "gpipe", "Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (PipeDream-Flush).", "strategy"
    )
    options: dict[str, Any] = setting(
        {}, "Each strategy's own options (its `Options` dataclass), by strategy name; see `distrain strategies`."
    )


@dataclass(frozen=True)
class Checkpointing:
    """When checkpoints are written, and where a run starts from."""

    checkpoint_every: int = setting(0, "Also checkpoint every N epochs (0: only at the end).", "checkpointing")
    init_from: str = setting(
        "", "Start from this checkpoint (model, optimizer, step), whatever strategy wrote it.", "checkpointing"
    )
    checkpoint_steps: int = setting(
        0, "Also checkpoint every N global steps (0: off); recovery restarts from the latest.", "checkpointing"
    )


@dataclass(frozen=True)
class Faults:
    """Timeouts, failures to recover from, fault injection, non-finite values."""

    collective_timeout_s: float = setting(300.0, "Timeout for collective operations and rendezvous, seconds.", "faults")
    max_failures: int = setting(
        3, "Failures (dead or hung workers/shards) to recover from before giving up (-1: no limit).", "faults"
    )
    hang_timeout_s: float = setting(
        300.0,
        "A worker or parameter-server wait silent this long is treated as dead, seconds. A worker answers once "
        "per segment (--segment-steps steps, emulated --comm-delay-ms waits included), so keep it well above that.",
        "faults",
    )
    chaos: list[str] = setting(
        (),
        "Fault injection: kill-worker@STEP[:RANK], kill-ps@STEP[:SHARD], hang-worker@STEP[:RANK], kill-node@STEP.",
        "faults",
        metavar="KIND@STEP",
    )
    on_nonfinite: str = setting(
        "stop",
        "A non-finite loss or gradient: stop (status diverged, exit code 3, no checkpoint written) or skip "
        f"that update (counted as nonfinite_steps in the summary; a run that skips more than "
        f"{SKIPPED_SHARE_LIMIT:.0%} of its steps, or whose final evaluation is not finite, ends diverged).",
        "faults",
    )


@dataclass(frozen=True)
class Stragglers:
    """Injected stragglers and how they are detected (backup workers and tasks: the bsp strategy's options)."""

    straggler: list[str] = setting(
        (),
        "RANK:SECONDS adds that delay to every step of that worker (repeatable; for experiments).",
        "stragglers",
        metavar="RANK:SECONDS",
    )
    straggler_threshold: float = setting(
        2.0,
        "Flag a worker as a straggler when its recent median compute time is this many times the others' and "
        "10 ms more, over two windows of 20 of its steps (released under half those margins).",
        "stragglers",
    )


@dataclass(frozen=True)
class Output:
    """What is recorded and where: the run directory, evaluations, the quality target, TensorBoard."""

    target: str = setting(
        "",
        "Quality target METRIC>=VALUE or METRIC<=VALUE (e.g. test_loss<=0.5) whose first crossing is reported "
        "as time to target; one outside the metric's range (accuracy above 1, a loss below 0) is refused.",
        "output",
        "the task's own (classification: test_accuracy>=--target-accuracy)",
    )
    target_accuracy: float = setting(
        0.95, "Test accuracy whose first crossing is reported as time-to-accuracy.", "output"
    )
    run_dir: str = setting("", "Run directory; must be new or empty.", "output", "runs/<timestamp>-<strategy>")
    eval_every: int = setting(1, "Evaluate on the held-out split every N epochs (0: only at the end).", "output")
    tensorboard: str = setting(
        "",
        "Write TensorBoard event files (training loss, lr, samples/s, test metrics) under DIR/<run id>/.",
        "output",
        metavar="DIR",
    )


SECTION_CLASSES: dict[str, type] = {
    "resources": Resources,
    "data": Data,
    "optimizer": Optimization,
    "strategy": StrategySection,
    "checkpointing": Checkpointing,
    "faults": Faults,
    "stragglers": Stragglers,
    "output": Output,
}
# Every field but the strategies' options, by its flat name (the flag's, and old flat config files' key).
COMMON_FIELDS: dict[str, FieldInfo] = {
    info.name: info
    for cls in SECTION_CLASSES.values()
    for info in fields_of(cls)
    if info.name != "options" and not info.derived
}
FIELD_SECTION = {info.name: sec for sec, cls in SECTION_CLASSES.items() for info in fields_of(cls)}
# In nested YAML a section's main choice is called `name` (strategy.name, optimizer.name).
NESTED_NAME = {"strategy": "strategy", "optimizer": "optimizer"}


def strategies_named(strategy: str, schedule: str = "", epochs: int = 0) -> list[type[Strategy]]:
    """The strategy classes a run uses: its strategy, or every one its --schedule names (in order, once)."""
    from distrain.strategies.strategy_lookup import strategy_class

    names = [strategy]
    if schedule:
        from distrain.strategies.strategy_schedule import parse_schedule

        names = [p.strategy for p in parse_schedule(schedule, max(epochs, 1))]
    return [strategy_class(n) for n in dict.fromkeys(names)]


def option_fields(classes: list[type[Strategy]] | None = None) -> dict[str, FieldInfo]:
    """The strategies' own options by name (the built-in strategies' when `classes` is None)."""
    if classes is None:
        from distrain.strategies import STRATEGIES

        classes = [STRATEGIES.get(n) for n in STRATEGIES.names()]
    found: dict[str, FieldInfo] = {}
    for cls in classes:
        for info in fields_of(cls.Options):
            found.setdefault(info.name, info)
    return found


def known_option_fields() -> dict[str, FieldInfo]:
    """Options of the built-in strategies and of those imported by path so far in this process."""
    from distrain.strategies.strategy_lookup import loaded_plugins

    return option_fields() | option_fields(loaded_plugins())


def strategy_dependent_fields() -> tuple[str, ...]:
    return STRATEGY_COMMON_DEPENDENT + tuple(known_option_fields())


def flatten(mapping: dict[str, Any]) -> dict[str, Any]:
    """A config mapping as flat keys: nested sections (what config.yaml holds now) are opened; flat keys
    (what config files written before the sections held, and what flags give) stay as they are."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if key in SECTION_CLASSES and isinstance(value, dict):
            for name, inner in value.items():
                if key == "strategy" and isinstance(inner, dict):  # one strategy's own options
                    for option, v in inner.items():
                        if option in flat and flat[option] != v:
                            raise ConfigError(
                                f"option {option!r} is given twice with different values ({flat[option]!r}, {v!r}); "
                                "strategies of one run share an option's value: keep one"
                            )
                        flat[option] = v
                    continue
                flat[NESTED_NAME.get(key, name) if name == "name" else name] = inner
        else:
            flat[key] = value
    return flat


class RunConfig:
    """A run, described by one frozen spec per concern (`SECTION_CLASSES`) plus the options of each
    strategy it uses (each strategy's own `Options` dataclass).

    Built from flat keys (flags, old config files) or nested sections (`from_mapping`). Building resolves
    what depends on other choices (the strategy's default transport, a strategy's default options, the
    task's absolute path) into new frozen objects, then checks every value; nothing is mutated after, and
    `replace` builds a new config. Flat reads (`config.workers`, `config.tau`) reach into the sections.
    """

    def __init__(self, **values: Any) -> None:
        sections = _resolve_common(values)
        self.__dict__["_sections"] = sections
        options = _strategy_options(self, values)  # resolved against the sections above
        sections["strategy"] = dataclasses.replace(sections["strategy"], options=options)
        self.validate()

    # ------------------------------------------------------------------ reading
    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("_sections")
        if sections is None or name.startswith("__"):
            raise AttributeError(name)
        section = FIELD_SECTION.get(name)
        if section is not None and name != "options":
            return getattr(sections[section], name)
        for options in sections["strategy"].options.values():
            if hasattr(options, name):
                return getattr(options, name)
        known = option_fields()
        if name in known:  # an option of a strategy this run does not use: its unset value
            return known[name].default
        raise AttributeError(f"RunConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RunConfig is immutable; use config.replace({name}=...)")

    def section(self, name: str) -> Any:
        """One section's frozen spec, e.g. config.section("resources").workers."""
        return self._sections[name]

    def options_of(self, strategy: str) -> Any:
        """The resolved `Options` of one strategy of this run (by its name, e.g. "local-sgd")."""
        try:
            return self._sections["strategy"].options[strategy]
        except KeyError:
            raise KeyError(f"strategy {strategy!r} is not used by this run") from None

    @property
    def strategy_name(self) -> str:
        """The run's (first) strategy's own name: "bsp", or a plugin's `name` ("easgd"), for labels."""
        return self.strategy_classes[0].name

    @property
    def strategy_classes(self) -> list[type[Strategy]]:
        return strategies_named(self.strategy, self.schedule, self.epochs)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with `changes`; a task object fit() ships (orchestrator/tasks.py) stays with it unless
        the task itself changes (the planner's calibration runs copies of the run's config)."""
        return _rebuild(self.to_dict() | changes, None if "task" in changes else self.__dict__.get("_task_object"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and self.to_nested() == other.to_nested()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RunConfig({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __reduce__(self) -> Any:
        # Rebuilt from its values in another process (Ray ships configs to workers); a task object handed
        # to fit() (orchestrator/tasks.py) travels with it.
        return (_rebuild, (self.to_dict(), self.__dict__.get("_task_object")))

    # ------------------------------------------------------------------ validation (reads only)
    def validate(self) -> None:
        """Check every value; the message of the first problem names the flag and the fix."""
        from distrain.trainers.builtin_names import check_dataset, check_model

        check_model(self.model)
        check_dataset(self.dataset)
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
        if self.comm_bandwidth is not None:
            from distrain.units import parse_rate

            parse_rate(self.comm_bandwidth)
        from distrain.compression import parse_codec

        if self.compress is not None:
            codec = parse_codec(self.compress)
            if codec is not None:
                for cls in self.strategy_classes:
                    cls.implementation(self).check_codec(self, codec)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown --precision {self.precision!r}; choose one of: {', '.join(PRECISIONS)}")
        if self.precision == "fp16" and self.compress is not None and parse_codec(self.compress) is not None:
            # An overflow step's inf would enter the codec's error-feedback residual and stay there.
            raise ConfigError("--precision fp16 cannot be combined with --compress; use --precision bf16 instead")
        for name in ("gpus_per_worker", "momentum", "weight_decay", "warmup_epochs", "comm_delay_ms"):
            value = getattr(self, name)
            if value is None:  # momentum of an optimizer without one
                continue
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.comm_delay_ms and self.comm_delay_ms / 1000 >= self.hang_timeout_s:
            # A worker answers the driver once per segment, and a segment with a transfer in it lasts at
            # least one emulated delay: every such run would end with its workers taken for hung.
            raise ConfigError(
                f"--comm-delay-ms {self.comm_delay_ms:g} ({self.comm_delay_ms / 1000:g} s per transfer) reaches "
                f"--hang-timeout-s {self.hang_timeout_s:g}: every worker would be taken for hung while it waits on "
                "the emulated link; raise --hang-timeout-s well above the delay or lower --comm-delay-ms"
            )
        if not 0 <= self.seed < 2**64:  # numpy's default_rng refuses negative seeds, torch's > 64 bits
            raise ConfigError(f"--seed must be in [0, 2**64), got {self.seed}")
        if self.momentum is not None and self.momentum >= 1:
            raise ConfigError(f"--momentum must be < 1, got {self.momentum}")
        if self.warmup_epochs > self.epochs:
            raise ConfigError(f"--warmup-epochs ({self.warmup_epochs}) exceeds --epochs ({self.epochs}); lower it")
        for options in self._sections["strategy"].options.values():
            options.check(self)
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
        self._validate_lr_decay()
        self._validate_pipeline()
        if self.worker_memory:
            from distrain.orchestrator.memory import parse_bytes

            try:
                if parse_bytes(self.worker_memory) <= 0:
                    raise ValueError
            except ValueError:
                raise ConfigError(
                    f"--worker-memory takes a size such as 3GiB or 512MiB, got {self.worker_memory!r}"
                ) from None
        self._validate_elastic()
        # Last: the optimizer's own constructor checks its arguments, which needs torch (every other flag
        # error is found without it, in well under a second).
        if self.optimizer.lower() not in OPTIMIZER_NAMES + REFUSED_OPTIMIZER_NAMES:  # torch need not load for this
            raise ConfigError(f"unknown --optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZER_NAMES)}")
        from distrain.trainers.optim_state import check_optimizer

        check_optimizer(self.optimizer, self.optimizer_args, self.momentum, self.weight_decay)

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

    def _validate_elastic(self) -> None:
        """A --workers range needs a strategy whose membership can change mid-run (`Strategy.elastic`):
        the others are refused naming those that can."""
        if not self.elastic:
            return
        given = f"--workers {format_workers(self.workers, self.max_workers)}"
        from distrain.strategies import STRATEGIES

        able = [name for name in STRATEGIES.names() if STRATEGIES.get(name).elastic]
        able += [  # those elastic on some transports only (bsp: over the collective)
            f"{name} over {'/'.join(STRATEGIES.get(name).elastic_transports)}"
            for name in STRATEGIES.names()
            if STRATEGIES.get(name).elastic_transports and not STRATEGIES.get(name).elastic
        ]
        if not all(cls.implementation(self).elastic for cls in self.strategy_classes):
            what = f"--schedule {self.schedule}" if self.schedule else f"--strategy {self.strategy}"
            raise ConfigError(
                f"{given}: {what} cannot change its membership mid-run; use a fixed --workers N, or a strategy "
                f"that can: {', '.join(able)}"
            )
        if self.backup_workers and self.workers - self.backup_workers < 1:
            # Under a range the b backups are among the members: each round applies k = members - b.
            raise ConfigError(
                f"{given} with --backup-workers {self.backup_workers}: each round applies members - "
                f"{self.backup_workers} gradients, none at MIN {self.workers}; raise MIN above {self.backup_workers}"
            )
        for flag, used in (
            ("--pipeline-stages", self.pipelined),
            ("--straggler", bool(self.straggler)),
            ("--schedule", bool(self.schedule)),
            # The collective re-form (orchestrator/elastic_collective.py): a codec's per-rank error
            # feedback is not carried across group sizes.
            ("--compress", self.compress is not None and self.transport == "collective"),
        ):
            if used:
                raise ConfigError(f"{given} does not compose with {flag}; use a fixed --workers N or drop {flag}")

    def _validate_pipeline(self) -> None:
        """--pipeline-stages composes with BSP over the collective transport only: each stage's gradient
        is all-reduced with its R copies before the step (strategies/pipeline.py says why not the rest)."""
        from distrain.strategies.pipeline import PIPELINE_SCHEDULES

        if self.pipeline_stages < 1:
            raise ConfigError(f"--pipeline-stages must be >= 1, got {self.pipeline_stages}")
        if self.microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, got {self.microbatches}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"unknown --pipeline-schedule {self.pipeline_schedule!r}; "
                f"choose one of: {', '.join(PIPELINE_SCHEDULES)}"
            )
        if not self.pipelined:
            if self.microbatches != 1:
                raise ConfigError("--microbatches cuts a pipeline's batch; add --pipeline-stages S (S >= 2) or drop it")
            return
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"--microbatches {self.microbatches} does not divide the per-replica batch --batch-size "
                f"{self.batch_size}; pick M that divides it"
            )
        if self.schedule or self.strategy != "bsp" or self.transport != "collective":
            raise ConfigError(
                "--pipeline-stages runs with --strategy bsp over the collective transport only (each stage's "
                "gradient is averaged with its replicas'); drop --pipeline-stages or use bsp"
            )
        if self.compress is not None or self.backup_workers:
            flag = "--compress" if self.compress is not None else "--backup-workers"
            raise ConfigError(f"{flag} does not compose with --pipeline-stages; drop one of them")
        if self.comm_delay_ms or self.comm_bandwidth:
            raise ConfigError("--comm-delay-ms/--comm-bandwidth do not apply to pipeline traffic; drop them")
        if self.precision != "fp32":  # the schedule's stages run outside LocalTrainer's autocast and loss scale
            raise ConfigError(f"--precision {self.precision} does not compose with --pipeline-stages; drop one of them")

    def _validate_task(self) -> None:
        """The built-in task's own flags do not apply to another task (here: those set to another value
        than their default; `refuse_builtin_options` also refuses those given at their default)."""
        if not self.task:
            if self.task_args:
                raise ConfigError("--task-arg applies to a --task of your own; the built-in task takes --model etc.")
            return
        for name in BUILTIN_TASK_FIELDS:
            if getattr(self, name) != COMMON_FIELDS[name].default:
                raise self._builtin_option_error(name)

    def refuse_builtin_options(self, given: Iterable[str], where: str = "") -> None:
        """A user task brings its own model and data: refuse the built-in task's options that were given
        (a flag, a fit() argument, a key of a YAML file the user wrote) even at their default value, as
        `--model cnn` is, which would otherwise be ignored in silence (and recorded in config.yaml)."""
        if not self.task:
            return
        for name in BUILTIN_TASK_FIELDS:
            if name in given:
                raise self._builtin_option_error(name, where)

    def _builtin_option_error(self, name: str, where: str = "") -> ConfigError:
        what = f"{name} (in {where})" if where else "--" + name.replace("_", "-")
        return ConfigError(
            f"{what} applies to the built-in classification task, not --task {self.task}; "
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
        """Like a strategy's options, --data-dir is refused where nothing reads it (--momentum and the
        other optimizer flags: `check_optimizer`)."""
        from distrain.trainers.builtin_names import DATASET_READS_FILES

        if self.data_dir and not DATASET_READS_FILES[self.dataset]:
            users = [n for n, reads in DATASET_READS_FILES.items() if reads]
            raise ConfigError(
                f"--data-dir is not used by --dataset {self.dataset} (it reads no files); drop it "
                f"(it applies to: {', '.join(users)})"
            )

    # ------------------------------------------------------------------ derived values
    @property
    def elastic(self) -> bool:
        """--workers MIN..MAX: membership changes while the run goes on (orchestrator/membership.py)."""
        return self.max_workers > 0

    @property
    def worker_range(self) -> tuple[int, int]:
        """(MIN, MAX) of the membership; (N, N) for a fixed size."""
        return self.workers, self.max_workers or self.workers

    @property
    def worker_slots(self) -> int:
        """Data-parallel ranks the run's books are kept for: N, or the MAX of a range. An elastic run's
        step is cut into MAX slices whoever is there to take them (each a B-sample unit), so the epoch's
        partition of samples never changes with the membership (algorithms.md, "Elastic membership")."""
        return self.max_workers or self.workers

    @property
    def global_batch_size(self) -> int:
        """Samples whose gradients make one update (the learning rate is scaled for this). An elastic
        run's is the MAX's: under the strategies that take a range each update is one worker's B samples
        whatever the membership, so the rate is the one the fixed run at MAX uses (README, elastic)."""
        return self.worker_slots * self.batch_size

    @property
    def num_worker_actors(self) -> int:
        """Worker actors (ranks) the run has room for: --workers (an elastic run's MAX) plus any backup
        workers, times --pipeline-stages (each replica of the model is S actors, one per stage). Under a
        range the backups are among the MAX (a round applies members - b gradients)."""
        return (self.worker_slots + (0 if self.elastic else self.backup_workers)) * self.pipeline_stages

    @property
    def pipelined(self) -> bool:
        return self.pipeline_stages > 1

    @property
    def samples_per_step(self) -> int:
        """Samples handed out per step: with backup workers, b x B more than the update uses."""
        return (self.worker_slots + (0 if self.elastic else self.backup_workers)) * self.batch_size

    @property
    def straggler_delays(self) -> dict[int, float]:
        return parse_stragglers(self.straggler, self.num_worker_actors)

    @property
    def chaos_events(self) -> list[ChaosEvent]:
        return parse_chaos(self.chaos, self.worker_slots * self.pipeline_stages, self.ps_shards)

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_worker > 0

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Flat keys (as flags name them): every section's fields, then the options of the strategies used."""
        flat = {name: _plain(getattr(self._sections[FIELD_SECTION[name]], name)) for name in COMMON_FIELDS}
        flat["workers"] = format_workers(self.workers, self.max_workers)  # a range is written as it is given
        for options in self._sections["strategy"].options.values():
            flat |= dataclasses.asdict(options)
        return flat

    def to_nested(self) -> dict[str, dict[str, Any]]:
        """Sections as config.yaml holds them; the strategy section nests each strategy's options."""
        nested: dict[str, dict[str, Any]] = {}
        for name, section in self._sections.items():
            values: dict[str, Any] = {}
            for info in fields_of(type(section)):
                if info.name == "options":
                    for strategy, options in section.options.items():
                        values[strategy] = dataclasses.asdict(options)
                    continue
                if info.derived:  # written as part of the field it is given through
                    continue
                key = "name" if NESTED_NAME.get(name) == info.name else info.name
                values[key] = _plain(getattr(section, info.name))
            if name == "resources":
                values["workers"] = format_workers(self.workers, self.max_workers)
            nested[name] = values
        return nested

    def to_yaml(self) -> str:
        """config.yaml: one commented block per section, each field with its help text."""
        lines = [RECORDED_HEADER]
        nested = self.to_nested()
        for name, section in self._sections.items():
            lines.append(f"\n# --- {name}: {type(section).__doc__}")
            lines.append(f"{name}:")
            for info in fields_of(type(section)):
                if info.name == "options":
                    for strategy, options in section.options.items():
                        lines.append(f"  # options of the {strategy} strategy")
                        lines.append(f"  {yaml.safe_dump(strategy).strip().removesuffix('...').strip()}:")
                        for opt in fields_of(type(options)):
                            lines.append(f"    # {opt.help}")
                            dumped = yaml.safe_dump({opt.name: getattr(options, opt.name)}, sort_keys=False)
                            lines.append("    " + dumped.rstrip())
                    continue
                if info.derived:
                    continue
                key = "name" if NESTED_NAME.get(name) == info.name else info.name
                lines.append(f"  # {info.help}")
                dumped = yaml.safe_dump({key: nested[name][key]}, sort_keys=False, default_flow_style=True)
                lines.append("  " + dumped.strip().removeprefix("{").removesuffix("}"))
        return "\n".join(lines) + "\n"

    @classmethod
    def field_names(cls, values: dict[str, Any] | None = None) -> list[str]:
        """Every flat key a config may hold: the sections' fields and the strategies' options (the
        built-in strategies', and those of a strategy `values` names by import path)."""
        names = list(COMMON_FIELDS) + list(option_fields())
        if values is not None:
            names += [n for n in _plugin_option_fields(values) if n not in names]
        return names

    @classmethod
    def field_info(cls, name: str, values: dict[str, Any] | None = None) -> FieldInfo:
        """One field's type, default, help and section, for the CLI and for Tune's sweep dimensions."""
        if name in COMMON_FIELDS:
            return COMMON_FIELDS[name]
        known = known_option_fields() | (_plugin_option_fields(values) if values else {})
        if name in known:
            return known[name]
        valid = list(COMMON_FIELDS) + list(known)
        raise ConfigError(f"unknown config field {name!r}; valid fields: {', '.join(valid)}")

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "configuration") -> RunConfig:
        flat = flatten(values)
        unknown = sorted(set(flat) - set(cls.field_names(flat)) - set(known_option_fields()))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(unknown)} in {source}; valid keys: {', '.join(cls.field_names(flat))}"
            )
        return cls(**flat)

    @classmethod
    def load_yaml(cls, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read a YAML config file into a flat mapping (validated when merged into a RunConfig)."""
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
        data = flatten(data)
        if text.startswith(RECORDED_HEADER) and data.get("optimizer") in LEGACY_MOMENTUM[1]:
            # Runs recorded before momentum became sgd-only wrote its old default for every optimizer;
            # that value was never read, and must not stop `--config` or `--resume` of such a run.
            if data.get("momentum") == LEGACY_MOMENTUM[0]:
                data["momentum"] = None
        return data

    @classmethod
    def resolve(cls, config_file: str | None, overrides: dict[str, Any]) -> RunConfig:
        """Defaults, then the YAML file, then explicit flags (those not None)."""
        values, given = cls._file_and_flags(config_file, overrides)
        config = cls.from_mapping(overlay(values, given), config_file or "configuration")
        config.refuse_builtin_options(given)
        # A config.yaml distrain wrote holds every key (a user task's run records the built-in's defaults);
        # a file the user wrote holds what they chose.
        if config_file and not _recorded_by_distrain(config_file):
            config.refuse_builtin_options(values, config_file)
        return config

    @classmethod
    def given_values(cls, config_file: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
        """What the YAML file and the explicit flags (those not None) set, flags over the file, before
        any default: what `resolve` builds from, and what a sweep's trials start from (each trial takes
        its own strategy's defaults for the rest, e.g. diloco's inner --lr)."""
        return overlay(*cls._file_and_flags(config_file, overrides))

    @classmethod
    def _file_and_flags(
        cls, config_file: str | None, overrides: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The YAML file's keys (checked to be known) and the explicit flags (those not None)."""
        values: dict[str, Any] = {}
        source = "configuration"
        if config_file:
            values.update(cls.load_yaml(config_file))
            source = config_file
        unknown = sorted(set(values) - set(cls.field_names(values)))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(unknown)} in {source}; valid keys: {', '.join(cls.field_names(values))}"
            )
        return values, {k: v for k, v in overrides.items() if v is not None}


def _recorded_by_distrain(path: str | os.PathLike[str]) -> bool:
    """The file is a config.yaml distrain wrote (its header line, perhaps under a comment of --strategy auto)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = [f.readline() for _ in range(20)]
    return any(line.rstrip("\n") == RECORDED_HEADER for line in head)


def _rebuild(values: dict[str, Any], task_object: Any) -> RunConfig:
    config = RunConfig(**values)
    if task_object is not None:
        config.__dict__["_task_object"] = task_object
    return config


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _plugin_option_fields(values: dict[str, Any]) -> dict[str, FieldInfo]:
    """Options of strategies `values` names by import path (built-in ones are known already)."""
    from distrain.plugins import is_import_path

    name = str(values.get("strategy") or "")
    if not is_import_path(name):
        return {}
    from distrain.strategies.strategy_lookup import strategy_class

    return option_fields([strategy_class(name)])


def _resolve_common(values: dict[str, Any]) -> dict[str, Any]:
    """The sections of a config from flat `values`: each value checked against its field's type, and
    what depends on other choices resolved (the strategy a schedule starts with, the transport, the
    number of shards, the task's and a strategy plugin's absolute paths)."""
    from distrain.plugins import absolute_import_path, check_import_path_exists, is_import_path, split_import_path

    values = dict(values)
    workers_given = values.get("workers")
    max_given = values.pop("max_workers", None)  # a rebuilt config's (to_dict writes the range into `workers`)
    workers, max_workers = parse_workers(COMMON_FIELDS["workers"].default if workers_given is None else workers_given)
    if max_given:
        workers, max_workers = parse_workers((workers, max_given))
    values["workers"] = workers
    v = {name: coerce(info.kind, values.get(name, info.default), info.flag) for name, info in COMMON_FIELDS.items()}
    v["max_workers"] = max_workers
    if v["schedule"]:
        if v["epochs"] < 1:
            raise ConfigError(f"--epochs must be >= 1, got {v['epochs']}")
        from distrain.strategies.strategy_schedule import parse_schedule

        # The first entry is the run's strategy (and names the run directory).
        v["strategy"] = parse_schedule(v["schedule"], v["epochs"])[0].strategy
    if is_import_path(v["strategy"]):
        # Recorded absolute, so Tune trials (own working directories) and --config repeats load the same file.
        v["strategy"] = absolute_import_path(v["strategy"], "--strategy")
    phases = strategies_named(v["strategy"], v["schedule"], v["epochs"])
    strategy = phases[0]
    for name, default in strategy.run_defaults.items():
        if values.get(name) is None:
            v[name] = coerce(COMMON_FIELDS[name].kind, default, COMMON_FIELDS[name].flag)
    if not v["transport"]:
        v["transport"] = strategy.transports[0]
    if v["transport"] not in ("collective", "ps"):
        raise ConfigError(f"unknown --transport {v['transport']!r}; choose collective or ps")
    if v["transport"] not in strategy.transports:
        raise ConfigError(
            f"--transport {v['transport']} cannot carry --strategy {v['strategy']}; "
            f"it runs on: {', '.join(strategy.transports)}"
        )
    if v["schedule"] and v["transport"] != strategy.transports[0]:
        raise ConfigError(
            f"--transport {v['transport']} cannot be combined with --schedule: each phase runs on its "
            "strategy's default transport; drop --transport"
        )
    if v["transport"] == "ps" or any(s.transports[0] == "ps" for s in phases):
        if v["ps_shards"] is None:
            v["ps_shards"] = 1
        if v["ps_shards"] < 1:
            raise ConfigError(f"--ps-shards must be >= 1, got {v['ps_shards']}")
    elif v["ps_shards"] is not None:
        raise ConfigError("--ps-shards needs the parameter-server transport; add --transport ps or drop it")
    if v["task"] and not v["task"].startswith("object:"):  # object: a task object handed to distrain.fit
        split_import_path(v["task"], "--task")
        v["task"] = absolute_import_path(v["task"], "--task")
        check_import_path_exists(v["task"], "--task")
    if v["optimizer"].lower() in OPTIMIZER_NAMES:  # any case; an unknown name is reported as given
        v["optimizer"] = v["optimizer"].lower()
    return {
        section: cls(**{info.name: v[info.name] for info in fields_of(cls) if info.name != "options"})
        for section, cls in SECTION_CLASSES.items()
    }


def _strategy_options(run: RunConfig, values: dict[str, Any]) -> dict[str, Any]:
    """Each strategy's own options from the flat `values`, resolved against `run`; an option given for
    a strategy this run does not use is refused, naming the strategies that use it."""
    from distrain.fields import build

    phases = run.strategy_classes
    mine = option_fields(phases)
    known = known_option_fields() | mine
    options = {}
    for cls in phases:
        names = {info.name for info in fields_of(cls.Options)}
        given = {k: v for k, v in values.items() if k in names}
        options[cls.name] = build(cls.Options, given).resolved(run)
    user = f"--schedule {run.schedule}" if run.schedule else f"--strategy {run.strategy}"
    for name, value in values.items():
        if name in COMMON_FIELDS or name in mine:
            continue
        if name not in known:
            valid = list(COMMON_FIELDS) + list(known)
            raise ConfigError(f"unknown config field {name!r}; valid fields: {', '.join(valid)}")
        given_value = None if value is None else coerce(known[name].kind, value, known[name].flag)
        # An on/off option given as off asks nothing of a strategy that has no such thing (--no-staleness-lr
        # with bsp; flat config files of earlier versions wrote every unused switch as false).
        if given_value is not None and given_value is not False and given_value != known[name].default:
            from distrain.strategies import STRATEGIES
            from distrain.strategies.strategy_lookup import loaded_plugins

            classes = [STRATEGIES.get(n) for n in STRATEGIES.names()] + loaded_plugins()
            users = [c.name for c in classes if name in {i.name for i in fields_of(c.Options)}]
            raise ConfigError(
                f"--{name.replace('_', '-')} is not used by {user}; drop it (it applies to: {', '.join(users)})"
            )
    return options
