"""The CPU copies a sharded checkpoint is written from, kept from one save to the next.

A save blocks training only while each worker copies its pieces of the state (its parameters' and
optimizer's local shards) somewhere the training will not touch; a thread writes them from there. DCP's
own `async_save` stages through a fresh `DefaultStager` per call: a Python deepcopy of every entry (each
DTensor's spec and device mesh included) into newly allocated storage, the whole of a padded FSDP
shard's storage too. Here each entry's copy is made once, a DTensor over a CPU buffer with the source's
own spec, and later saves only `copy_` into it: no allocation, no deepcopy, the same DTensors for DCP to
plan from. A save may reuse the buffers only once the previous one is written (AsyncSaver waits for it).

On a GPU the buffers are pinned and the copies non-blocking, with one synchronisation at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Staged:
    source_spec: Any  # the source DTensor's spec (None for a plain tensor): a new one means a new copy
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    value: torch.Tensor  # what DCP is handed: the CPU buffer, or a DTensor over it
    buffer: torch.Tensor  # the CPU buffer itself


class StagingBuffers:
    """One CPU copy per checkpoint entry, reused while the entry keeps its shape, dtype and layout."""

    def __init__(self) -> None:
        self._staged: dict[str, _Staged] = {}

    def stage(self, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`entries` copied to CPU memory, as the tensors (or DTensors) DCP writes; returns when the copy is
        done, so training may change the sources at once."""
        from torch.distributed.tensor import DTensor

        staged: dict[str, torch.Tensor] = {}
        on_gpu = False
        for name, value in entries.items():
            spec = value._spec if isinstance(value, DTensor) else None
            local = value._local_tensor if spec is not None else value
            local = local.detach()
            kept = self._staged.get(name)
            if kept is None or not self._fits(kept, spec, local):
                kept = self._new(spec, local)
                self._staged[name] = kept
            kept.buffer.copy_(local, non_blocking=local.is_cuda)
            on_gpu = on_gpu or local.is_cuda
            staged[name] = kept.value
        for name in [n for n in self._staged if n not in entries]:  # an entry gone: its copy goes too
            del self._staged[name]
        if on_gpu:
            torch.cuda.synchronize()
        return staged

    def clear(self) -> None:
        self._staged.clear()

    @staticmethod
    def _fits(kept: _Staged, spec: Any, local: torch.Tensor) -> bool:
        return (
            kept.source_spec is spec
            and kept.shape == local.shape
            and kept.dtype == local.dtype
            and kept.device == local.device
        )

    @staticmethod
    def _new(spec: Any, local: torch.Tensor) -> _Staged:
        from torch.distributed.tensor import DTensor

        buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
        # The source's spec (mesh, placements, global shape) as it is: what DCP's own staging copies too.
        value = DTensor(buffer, spec, requires_grad=False) if spec is not None else buffer
        return _Staged(spec, local.shape, local.dtype, local.device, value, buffer)
