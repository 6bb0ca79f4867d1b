"""A tiny regression whose `loss` logs two scalars of its own each step (`(loss, {name: value})`): the
--loggers and --storage acceptance test's task. `rows` is the batch's sample count and `mse` the loss
itself, so each can be checked against what distrain records beside it."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distrain


class LoggingRegression(distrain.Task):
    def __init__(self, n: int = 160) -> None:
        self.n = n

    def build_model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        return TensorDataset(x[:-32], y[:-32]), TensorDataset(x[-32:], y[-32:])

    def loss(self, model, batch):
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        return loss, {"mse": loss.detach(), "rows": float(batch[0].shape[0])}
