"""--precision: the dtype a replica computes its forward pass in, and fp16's loss scale.

Mixed precision keeps the parameters, the gradients in `grads_flat`, the optimizer state and
everything on the wire in float32; only the forward pass (and so backward's intermediate values)
runs in bf16 or fp16 under `torch.autocast`. That keeps it apart from `--compress bf16`, which
changes what travels and nothing that is computed.

fp16's range is small (max 65504, smallest normal 6e-5): the loss is multiplied by a scale before
backward so that small gradients do not flush to zero, and the gradient is divided by it again
before it is used. A step whose (unscaled) gradient is not finite is skipped and the scale halved;
after `growth_interval` clean steps it doubles (torch.amp.GradScaler's rule and defaults). distrain
keeps its own scaler instead of torch's GradScaler because the skip decision has to be taken by the
strategy on the gradient it actually uses (the all-reduced one under BSP, so every replica skips the
same steps and keeps the same scale; the local one before a push under the PS strategies, so a shard
never receives a non-finite gradient), not inside `optimizer.step()` on one replica's gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context the forward pass runs in (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


@dataclass
class LossScaler:
    """fp16's dynamic loss scale (torch.amp.GradScaler's defaults)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0  # steps since the last overflow or growth
    overflows: int = 0  # steps skipped for a non-finite gradient, over the run

    # The scale has fallen this low: the gradient is not finite at any scale, so it is divergence, not
    # fp16 overflow (a scale below 1 makes small gradients smaller, the opposite of its purpose).
    MIN_SCALE = 1.0

    def update(self, overflow: bool) -> None:
        """After a step: halve on a non-finite gradient, double after `growth_interval` clean steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.overflows += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    @property
    def exhausted(self) -> bool:
        return self.scale < self.MIN_SCALE

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
