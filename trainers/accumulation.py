"""Gradient accumulation (--accumulate-steps k): one update's batch of k x B samples, computed as k
micro-batches of B whose gradients add up in the flat buffer before the strategy communicates.

Each micro-batch's loss (a mean over its samples) is weighted by its share of the samples, so the
accumulated gradient is the gradient of the mean loss over all k x B: the same update one worker would
make at batch k x B, up to float rounding (tests/integration/test_accumulation_runs.py).
"""

from __future__ import annotations

from typing import Any

import torch


def split_batch(batch: Any, k: int, n: int) -> list[Any]:
    """`batch` (of `n` samples) cut into `k` parts along the first dimension of every tensor whose first
    dimension is `n`, through tuples, lists and dicts; anything else is shared by every part."""
    if k == 1:
        return [batch]
    if n < k:
        raise ValueError(f"a batch of {n} samples cannot be cut into --accumulate-steps {k} micro-batches")
    bounds = [n * i // k for i in range(k + 1)]
    return [_part(batch, n, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def _part(value: Any, n: int, lo: int, hi: int) -> Any:
    if torch.is_tensor(value):
        return value[lo:hi] if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, dict):
        return {key: _part(v, n, lo, hi) for key, v in value.items()}
    if isinstance(value, tuple | list):
        parts = [_part(v, n, lo, hi) for v in value]
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)  # a namedtuple too
    return value
