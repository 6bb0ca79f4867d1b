"""A task whose pipeline stages are compute-heavy and equal: the bubble and memory tests' model.

S x 2 equal blocks of Linear(1024, 1024) + tanh on random data (a regression to a fixed random
projection): 8.4M parameters at S = 4; 2.1M per stage at S = 2. A micro-batch of 16 rows costs a
stage ~2 x 2 x 16 x 1024^2 = 67M multiply-adds forward, while its activation (16 x 1024 float32,
64 KiB) crosses gloo in well under a millisecond, so stage compute dominates point-to-point time.
`width` makes it small (the memory-budget test's model: equal blocks, so S stages hold 1/S each).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distrain

WIDTH = 1024


class WideMLP(distrain.Task):
    def __init__(self, blocks: int = 4, samples: int = 512, width: int = WIDTH, tp_plan: bool = False) -> None:
        self.blocks, self.samples, self.width, self.tp_plan = blocks, samples, width, tp_plan

    def build_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(self.blocks):
            layers += [nn.Linear(self.width, self.width), nn.Tanh()]
        return nn.Sequential(*layers)

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, self.width, generator=g)
        y = torch.tanh(x @ (torch.randn(self.width, self.width, generator=g) / self.width**0.5))
        return TensorDataset(x[: self.samples - 64], y[: self.samples - 64]), TensorDataset(x[-64:], y[-64:])

    def split_points(self):
        return [str(2 * i) for i in range(1, self.blocks)]  # before each Linear but the first

    def tensor_parallel_plan(self, tp: int):
        # With `tp_plan`: the second block's Linear column-wise, the third's row-wise; at S = 2 the stage
        # boundary falls between them (each TP rank hands its slice of the features to the next stage's).
        return {"2": "colwise", "4": "rowwise"} if self.tp_plan and self.blocks >= 3 else None

    def criterion(self, output, batch):
        return nn.functional.mse_loss(output, batch[1])
