"""Model registry. Every builder takes the data set's shape, so any model trains on any data set."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from distrain.name_registry import Registry
from distrain.trainers.datasets import DatasetInfo

MODELS: Registry[Callable[[DatasetInfo], nn.Module]] = Registry("model")


@MODELS.register("linear", "one dense layer on the flattened image: multinomial logistic regression (convex)")
def linear(info: DatasetInfo) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(info.channels * info.height * info.width, info.num_classes))


@MODELS.register("mlp", "two hidden layers of 256 units")
def mlp(info: DatasetInfo) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(info.channels * info.height * info.width, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, info.num_classes),
    )


@MODELS.register("cnn", "two 3x3 conv layers, pooling to 4x4, two dense layers (~150k params)")
def cnn(info: DatasetInfo) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(info.channels, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        # Adaptive pooling makes the head independent of the image size (8x8 digits, 28x28, 32x32).
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, info.num_classes),
    )


@MODELS.register("resnet18", "torchvision ResNet-18 with a 3x3 stem and no max-pool, for small images")
def resnet18(info: DatasetInfo) -> nn.Module:
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(weights=None, num_classes=info.num_classes)
    # The ImageNet stem (7x7 stride 2 + max-pool) would shrink an 8x8 or 32x32 image to nothing.
    model.conv1 = nn.Conv2d(info.channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """`build()` with torch's global RNG seeded by `seed` (same seed, same initial weights on every
    worker) and left as it was afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def seed_globals(seed: int, rank: int) -> None:
    """Seed torch's, NumPy's and Python's global RNGs for worker `rank` of a run with `seed`: what the
    task draws from them (dropout masks, random augmentation) is the same in every run with that seed,
    in a fresh process or a warm one, and differs between ranks. (torch seeds a new process at random.)"""
    state = np.random.SeedSequence([seed, rank]).generate_state(2)
    torch.manual_seed(int(state[0]))
    np.random.seed(int(state[1]))
    random.seed(int(state[0]) ^ int(state[1]))


def use_deterministic_kernels() -> None:
    """Make torch pick deterministic kernels from here on, in this process (`--deterministic`).

    On the CPU torch's kernels already are; on a GPU cuDNN's autotuner and atomics in some backward
    kernels are not, and cuBLAS needs a fixed workspace, which it reads from the environment when CUDA
    starts: so this runs before the worker's first CUDA call. warn_only: an op with no deterministic
    kernel warns instead of failing the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def build_model(name: str, info: DatasetInfo, seed: int) -> nn.Module:
    """Build `name` with its initial weights fixed by `seed` (same seed, same weights on every worker)."""
    builder = MODELS.get(name)
    return seeded(lambda: builder(info), seed)


def parameter_sizes(name: str, info: DatasetInfo) -> list[int]:
    """Values of each trainable tensor of `name` for `info`, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = MODELS.get(name)(info)
    return [p.numel() for p in model.parameters() if p.requires_grad]
