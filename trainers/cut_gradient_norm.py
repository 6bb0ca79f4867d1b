"""--clip-grad-norm over a cut replica's gradient (`--fsdp D`, `--tensor-parallel T`, `--pipeline-stages S
--fsdp D`): the global L2 norm of the whole gradient one update applies, each element counted once, and
torch's clip_grad_norm_ rule on it (scale by limit / (norm + 1e-6) where that is below 1).

A worker holds pieces of the gradient of three kinds: a DTensor's piece cut over some mesh dimensions
(FSDP's Shard/_StridedShard, a tensor-parallel split), the same piece held again by the workers that
differ from it only along a dimension where the tensor is replicated (HSDP's "replicate", a row-wise
layer's bias on "tp"), and, under tensor parallelism, tensors the plan leaves whole, which every one of
a data-parallel rank's T workers holds alike (plain tensors, or DTensors on FSDP's mesh without "tp").
Each worker sums the squares of the pieces it is the first holder of (coordinate 0 along every
dimension it is replicated over, and tensor-parallel rank 0 for what the T workers hold alike), and one
all-reduce over the workers holding the update's gradient adds them up: every element once, whatever
the layout (a pipeline's stages hold different tensors, so their sums simply add). torch's own
clip_grad_norm_ cannot: it stacks the per-tensor norms, and a tensor-parallel replica holds DTensors on
different meshes and plain tensors side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def is_cut(placement: Any) -> bool:
    """Whether a DTensor placement cuts the tensor (Shard, and FSDP-over-TP's _StridedShard, whose
    `is_shard()` says False): neither a copy (Replicate) nor a pending sum (Partial)."""
    return not (placement.is_replicate() or placement.is_partial())


def first_holder_piece(grad: torch.Tensor, tp_rank: int) -> torch.Tensor | None:
    """This worker's local piece of `grad` if it is the piece's first holder (None otherwise); a Partial
    placement is summed first (its local values are addends, not elements)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(grad, DTensor):
        return grad if tp_rank == 0 else None  # a whole tensor: the T workers hold it alike
    if any(p.is_partial() for p in grad.placements):
        placements = [Replicate() if p.is_partial() else p for p in grad.placements]
        grad = grad.redistribute(grad.device_mesh, placements)
    mesh = grad.device_mesh
    for dim, placement in enumerate(grad.placements):
        if not is_cut(placement) and mesh.get_local_rank(dim) != 0:
            return None
    if tp_rank != 0 and "tp" not in (mesh.mesh_dim_names or ()):
        return None  # not split over "tp": the T workers hold the same pieces
    return grad.to_local()


def cut_gradient_norm(grads: Sequence[torch.Tensor], group: Any = None, tp_rank: int = 0) -> torch.Tensor:
    """The L2 norm (float64, on the CPU) of the whole gradient whose pieces the workers of `group` (None:
    the run's) hold, `grads` being this worker's; every worker of `group` calls it (a collective)."""
    import torch.distributed as dist

    pieces = [first_holder_piece(g, tp_rank) for g in grads]
    squares = [p.detach().double().pow(2).sum() for p in pieces if p is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    total = total.reshape(1).to(device)
    dist.all_reduce(total, group=group)
    return total.sqrt().reshape(()).cpu()


def clip_cut_gradient_(grads: Sequence[torch.Tensor], limit: float, group: Any = None, tp_rank: int = 0) -> float:
    """Scale every piece of the gradient by limit / (norm + 1e-6) where that is below 1 (torch's rule);
    the norm as `cut_gradient_norm`. Returns the norm. A gradient that is not finite stays so (a NaN norm
    scales nothing, an infinite one turns inf into NaN): the strategy's finiteness check decides."""
    from torch.distributed.tensor import DTensor

    norm = float(cut_gradient_norm(grads, group, tp_rank))
    coef = limit / (norm + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for g in grads:  # each piece where it lives (a DTensor's local part shares its storage)
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm
