"""The built-in models' and data sets' names, without importing torch.

`distrain run --model foo` and `--data-dir` with a data set that reads no files are flag errors, answered
before torch loads (under a second). The registries in models.py and datasets.py are the source of the
classes; a test holds these names to them.
"""

from __future__ import annotations

from distrain.errors import ConfigError

MODEL_NAMES = ("cnn", "linear", "mlp", "resnet18")
# Each built-in data set, and whether it reads files from --data-dir (False: bundled or generated).
DATASET_READS_FILES = {"cifar10": True, "digits": False, "mnist": True, "synthetic": False}
# The built-in models whose tensor-parallel plan is the hybrid (trainers/tensor_parallel.py): the T workers
# of a replica take their own samples each, so the global batch is T times larger. Known here, without
# torch, because the run's global batch is config arithmetic; a test holds it to BUILTIN_PLANS.
HYBRID_TP_MODELS = ("cnn",)


def tp_sample_ranks(model: str | None, task: str | None, tp: int) -> int:
    """The ways a data-parallel rank's T tensor-parallel workers split its samples: T under a hybrid plan
    (a built-in model's in HYBRID_TP_MODELS: the convolutions data-parallel, each worker on its own B
    samples), 1 where the T workers share one slice. The one switch that the batch arithmetic
    (config/layout_section.py), the work plan (strategies/sharded_bsp.py) and the gradient scaling
    (trainers/sharded_trainer.py, told by ShardedBSP) follow; a user's task does not take it yet
    (orchestrator/run_checks.py refuses a hybrid plan there)."""
    return tp if tp > 1 and not task and model in HYBRID_TP_MODELS else 1


def check_model(name: str) -> None:
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")


def check_dataset(name: str) -> None:
    if name not in DATASET_READS_FILES:
        raise ConfigError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_READS_FILES)}")
