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


def check_model(name: str) -> None:
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")


def check_dataset(name: str) -> None:
    if name not in DATASET_READS_FILES:
        raise ConfigError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_READS_FILES)}")
