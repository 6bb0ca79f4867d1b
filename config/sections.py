"""The run's spec: one frozen dataclass per concern (`SECTION_CLASSES`), each field a documented `setting`
(its flag, help text, section, shown default), and the fixed choices those fields take.

These are the declarations flags, YAML keys, `--help`, docs/reference/cli.md and Tune's dimensions are
made from. The checks of their values are registered next door (`section_checks.py`; the strategy section
and its checks: `strategy_section.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distrain.compression.spec import FLAG as CODEC_FLAG
from distrain.config.layout_section import LayoutSection
from distrain.config.strategy_section import StrategySection
from distrain.fields import FieldInfo, fields_of, setting
from distrain.trainers.builtin_names import DATASET_READS_FILES, MODEL_NAMES

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
BALANCE_MODES = ("none", "speed")  # --balance (config/shares_section.py)
# --loggers (orchestrator/loggers.py builds them)
LOGGER_NAMES = ("tensorboard", "csv", "mlflow")

# The options of the built-in classification task, which a user's --task does not read.
BUILTIN_TASK_FIELDS = ("model", "dataset", "data_dir", "target_accuracy")


def _one_of(names: Any, last: str = "or") -> str:
    """ "a, b or c": the catalog's names as a help text lists them (trainers/builtin_names.py, without torch)."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


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
    worker_groups: list[str] = setting(
        (),
        "A resource group of COUNT workers taking BATCH samples a step each, whose placement bundles ask for "
        "RESOURCE=AMOUNT (CPU, GPU, or a custom node resource such as fast=1, so Ray puts the group on its kind "
        "of node; repeatable, ranks dealt group by group). Replaces --workers and --batch-size: the global batch "
        "is the sum of COUNT x BATCH, each rank's share its group's BATCH (as --worker-weights; "
        "docs/heterogeneous.md).",
        "resources",
        "none",
        flag="--worker-group",
        metavar="NAME:COUNT:BATCH[:RESOURCE=AMOUNT,...]",
    )
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
        "e.g. 3GiB: a run whose largest worker would hold more is refused, naming the --pipeline-stages or "
        "--fsdp that fit.",
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
        True,
        "Read each worker's next batch on a background thread while the current one trains (a batch that "
        "costs under 0.5 ms of CPU to read is read in the step instead).",
        "data",
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
    seed: int = setting(
        0,
        "Seeds model init, data order and the workers' RNGs (dropout); equal seeds give equal runs on one transport.",
        "data",
    )
    deterministic: bool = setting(
        False,
        "Deterministic kernels (cuDNN, cuBLAS: torch.use_deterministic_algorithms): on a GPU, equal seeds then "
        "give equal runs and a recovered run matches an unbroken one; slower.",
        "data",
    )
    val_fraction: float = setting(
        0.1,
        "Share of the training set held out, seeded, as the validation split that targets, --checkpoint-best and "
        "Tune select on (built-in tasks, and tasks with carve_validation; a task returning (train, val, test) "
        "brings its own); 0: none, validation is then on the test set.",
        "data",
    )


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
    accumulate_steps: int = setting(
        1,
        "Gradient accumulation: micro-batches of --batch-size each worker adds up per update (k); the global "
        "batch is then workers x k x B, and a step (one metrics row per worker) is one update "
        "(docs/optimization.md).",
        "optimizer",
        metavar="K",
    )
    clip_grad_norm: float = setting(
        0.0,
        "Clip the global L2 norm of the gradient each update applies to this (0: off): after the all-reduce "
        "under bsp, each worker's push under the parameter-server strategies, each local step under local-sgd "
        "and diloco (docs/optimization.md).",
        "optimizer",
        metavar="NORM",
    )
    precision: str = setting(
        "fp32",
        "Forward pass dtype: fp32, bf16 or fp16 (torch.autocast; under --fsdp FSDP's mixed precision, which "
        "gathers parameters in that dtype; parameters, gradients, optimizer state and gradient traffic stay "
        "float32; fp16 adds a dynamic loss scale, checkpointed). "
        f"Not {CODEC_FLAG} bf16, which changes only what travels.",
        "optimizer",
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
    checkpoint_best: str = setting(
        "",
        "Keep the checkpoint of the evaluation with the best METRIC as checkpoints/best.pt (e.g. val_loss, "
        "val_accuracy; max:NAME or min:NAME says which way is better, else accuracy-like names are maximised).",
        "checkpointing",
        "off",
        metavar="METRIC",
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
        "RANK:SECONDS adds that delay to every step of that worker; RANK:xF makes its compute take F times as "
        "long (a slower machine; repeatable; for experiments).",
        "stragglers",
        metavar="RANK:SECONDS|RANK:xF",
    )
    straggler_threshold: float = setting(
        2.0,
        "Flag a worker as a straggler when its recent median compute time is this many times the others' and "
        "10 ms more, over two windows of 20 of its steps (released under half those margins).",
        "stragglers",
    )
    worker_weights: str = setting(
        "",
        "Heterogeneous workers' static shares, one weight per worker (e.g. 3,1): each step's global batch "
        "(--workers x --batch-size) is cut in proportion, each worker's gradient weighted by its share, so the "
        "update is still the whole batch's (bsp over either transport; local-sgd and diloco weigh their "
        "averages by the samples each replica took; under --pipeline-stages one weight per replica, cut in whole "
        "sets of micro-batches; under --fsdp/--tensor-parallel one weight per replica, in multiples of its "
        "data-parallel ranks, over the collective transport; docs/heterogeneous.md).",
        "stragglers",
        "equal",
        metavar="W1,W2,...",
    )
    balance: str = setting(
        "none",
        "none, or speed: the driver sets each worker's share of the step's batch in proportion to its measured "
        "speed (seconds per sample), moving them at segment starts only when the predicted step time falls by "
        "more than 10 % (by less than 1.5x: only once a window of new rows says so again); the global batch "
        "stays --workers x --batch-size (bsp, local-sgd, diloco, and under "
        "--pipeline-stages per replica in whole sets of micro-batches, under --fsdp/--tensor-parallel per replica "
        "in multiples of its data-parallel ranks; starts from --worker-weights if given). "
        "Under --workers MIN..MAX (over the collective): every step is MAX x "
        "--batch-size cut among the members; a joiner starts at the mean share, a leaver's is shared out.",
        "stragglers",
    )


@dataclass(frozen=True)
class Output:
    """What is recorded and where: the run directory, evaluations, the quality target, TensorBoard."""

    target: str = setting(
        "",
        "Quality target METRIC>=VALUE or METRIC<=VALUE (e.g. val_loss<=0.5) whose first crossing is reported "
        "as time to target; one outside the metric's range (accuracy above 1, a loss below 0) is refused.",
        "output",
        "the task's own (classification: val_accuracy>=--target-accuracy)",
    )
    target_accuracy: float = setting(
        0.95, "Validation accuracy whose first crossing is reported as time-to-accuracy.", "output"
    )
    run_dir: str = setting("", "Run directory; must be new or empty.", "output", "runs/<timestamp>-<strategy>")
    eval_every: int = setting(1, "Evaluate on the validation split every N epochs (0: only at the end).", "output")
    test_every_epoch: bool = setting(
        False, "Evaluate the test set at every evaluation too (default: once, at the end of the run).", "output"
    )
    tensorboard: str = setting(
        "",
        "Write TensorBoard event files (training loss, lr, samples/s, test metrics) under DIR/<run id>/.",
        "output",
        metavar="DIR",
    )
    loggers: str = setting(
        "",
        f"Log each step's figures (loss, lr, samples/s, the task's own scalars) and each evaluation's with "
        f"these, comma-separated: {_one_of(LOGGER_NAMES, 'and')} (tensorboard: RUN_DIR/tensorboard/; csv: "
        f"RUN_DIR/scalars.csv; mlflow: --mlflow-uri, needs the mlflow extra).",
        "output",
        metavar="NAME,...",
    )
    mlflow_uri: str = setting(
        "",
        "MLflow tracking URI for --loggers mlflow, e.g. sqlite:///runs/mlflow.db or http://host:5000.",
        "output",
        "sqlite:///<run dir's parent>/mlflow.db",
    )
    storage: str = setting(
        "",
        "Also keep the run on this storage: a local path or a pyarrow filesystem URI (s3://bucket/prefix; "
        "credentials and endpoint from AWS_* variables). The run directory is synced to URI/<run id>/ at each "
        "checkpoint and at the end; --resume, --init-from, report and load_model take such URIs.",
        "output",
        metavar="URI",
    )


SECTION_CLASSES: dict[str, type] = {
    "resources": Resources,
    "data": Data,
    "optimizer": Optimization,
    "strategy": StrategySection,
    "layout": LayoutSection,
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
