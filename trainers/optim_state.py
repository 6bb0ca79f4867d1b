"""Optimizers and their state in a *flat* form that any transport can hold.

A torch optimizer keeps state per parameter tensor. Because a replica's parameters are views into one
flat buffer (see `local_trainer`), the same state can be written as one flat vector per state key
(`momentum_buffer`, `sum`, `exp_avg`, ...) plus scalars (`step`). That form slices cleanly into
parameter-server shards and concatenates back, so a checkpoint taken under one transport restores
under another: all-reduce replicas and PS shards run the very same torch optimizer code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


def make_optimizer(
    name: str, params: list[nn.Parameter], lr: float, momentum: float | None, weight_decay: float
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


@dataclass
class FlatOptimizerState:
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> flat tensor over all params
    scalars: dict[str, float] = field(default_factory=dict)  # e.g. Adam's "step"

    def slice(self, start: int, stop: int) -> FlatOptimizerState:
        return FlatOptimizerState({k: v[start:stop].clone() for k, v in self.vectors.items()}, dict(self.scalars))

    @classmethod
    def concat(cls, parts: list[FlatOptimizerState]) -> FlatOptimizerState:
        if not parts or not parts[0].vectors:
            return FlatOptimizerState({}, dict(parts[0].scalars) if parts else {})
        keys = parts[0].vectors.keys()
        return cls({k: torch.cat([p.vectors[k] for p in parts]) for k in keys}, dict(parts[0].scalars))

    def to_dict(self) -> dict:
        return {"vectors": self.vectors, "scalars": self.scalars}

    @classmethod
    def from_dict(cls, data: dict) -> FlatOptimizerState:
        return cls(dict(data["vectors"]), dict(data["scalars"]))


def export_flat_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> FlatOptimizerState:
    states = [optimizer.state.get(p, {}) for p in params]
    if not any(states):
        return FlatOptimizerState()
    vectors: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    for key, value in states[0].items():
        if torch.is_tensor(value) and value.shape == params[0].shape and value.numel() == params[0].numel():
            vectors[key] = torch.cat([s[key].detach().reshape(-1).cpu() for s in states])
        else:
            scalars[key] = float(value)
    return FlatOptimizerState(vectors, scalars)


def import_flat_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], flat: FlatOptimizerState) -> None:
    """Replace the optimizer's per-parameter state with `flat` (which must cover exactly `params`)."""
    optimizer.state.clear()
    if not flat.vectors and not flat.scalars:
        return
    total = sum(p.numel() for p in params)
    for key, vec in flat.vectors.items():
        if vec.numel() != total:
            raise ValueError(f"optimizer state {key!r} has {vec.numel()} values for {total} parameters")
    offset = 0
    for p in params:
        n = p.numel()
        state: dict = {}
        for key, vec in flat.vectors.items():
            state[key] = vec[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype).clone()
        for key, value in flat.scalars.items():
            state[key] = torch.tensor(value, dtype=torch.float32)
        optimizer.state[p] = state
        offset += n
