"""What a pipeline stage's forward saves for backward, measured as it happens (strategies/pipeline.py's
per-stage memory figures). No torch import: it only calls methods of the tensors autograd hands it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class ActivationMeter:
    """Bytes of tensors autograd saves for backward, live and at most, counted through
    `saved_tensors_hooks` (parameters, which autograd also saves, excluded; views of one tensor count
    once each, so this is an upper bound on what a caching allocator would hold)."""

    def __init__(self, param_storage: int) -> None:
        self.param_storage = param_storage
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        # A DTensor (a tensor-parallel layer's input or weight) is a wrapper with no storage of its own:
        # what it holds is its local tensor.
        local = getattr(t, "_local_tensor", t)
        if local.untyped_storage().data_ptr() == self.param_storage:
            return t
        return _Held(t, local, self)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.t if isinstance(held, _Held) else held


class _Held:
    __slots__ = ("t", "n", "meter")

    def __init__(self, t: torch.Tensor, local: torch.Tensor, meter: ActivationMeter) -> None:
        self.t, self.n, self.meter = t, local.numel() * local.element_size(), meter
        meter.live += self.n
        meter.peak = max(meter.peak, meter.live)

    def __del__(self) -> None:  # the graph that saved it is freed (after its backward)
        self.meter.live -= self.n
