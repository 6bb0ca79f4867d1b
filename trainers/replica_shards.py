"""A cut replica's state as this worker holds it, for an elastic run across cut replicas
(strategies/elastic_cut.py): taken out of one trainer and put into another cut the same way.

Under `--fsdp D --tensor-parallel T` worker (d, t) of every replica holds the same pieces: the
tensor-parallel split t of each planned parameter, FSDP chunk d (dim 0) of that, and its optimizer state
cut alike. A re-formed device mesh changes only how many replicas there are, not D or T, so a worker's
pieces keep their layout: after a re-form each worker's fresh trainer takes its own pieces back
(`load_local`), and a joiner's worker (d, t) takes live worker (d, t)'s, a plain copy of local tensors
with no resharding arithmetic; fp16's loss scale goes with them. `whole_state` is the opposite: the
replica's D x T workers gather the whole model and optimizer state (a collective inside the replica),
for the driver's checkpoints in the layout-free form every reader takes.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from distrain.trainers.sharded_trainer import local_part

if TYPE_CHECKING:
    from distrain.trainers.sharded_trainer import ShardedTrainer


def local_state(trainer: ShardedTrainer) -> dict[str, Any]:
    """This worker's pieces, on the CPU: the model's state dict entries and, per trainable parameter (by
    name), its optimizer state (tensors cut as the parameter is, scalars as they are)."""
    assert trainer.optimizer is not None, "a cut trainer"
    model = {k: local_part(v).detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    state = {"model": model, "optim": optimizer_pieces(trainer.optimizer, trainer.params, trainer.names)}
    if trainer.scaler is not None:  # fp16's loss scale: every worker of the run holds the same
        state["scaler"] = trainer.scaler.state_dict()
    return state


def optimizer_pieces(optimizer: torch.optim.Optimizer, params: list[Any], names: list[str]) -> dict[str, Any]:
    """`optimizer`'s state over this worker's `params` (DTensors) by name, on the CPU: the inner optimizer's,
    or another over parts cut the same way (DiLoCo's outer optimizer over θ_g, strategies/elastic_cut.py)."""
    optim: dict[str, dict[str, Any]] = {}
    for p, name in zip(params, names, strict=True):
        optim[name] = {
            key: local_part(v).detach().cpu().clone() if torch.is_tensor(v) else v
            for key, v in optimizer.state.get(p, {}).items()
        }
    return optim


def load_local(trainer: ShardedTrainer, state: dict[str, Any]) -> None:
    """Put `local_state`'s pieces into `trainer`, cut as the one they came from was (same D): each
    parameter's local tensor copied; the optimizer state made DTensors again on this trainer's mesh."""
    assert trainer.optimizer is not None, "a cut trainer"
    if trainer.scaler is not None and state.get("scaler"):
        trainer.scaler.load_state_dict(state["scaler"])
    with torch.no_grad():
        own = trainer.model.state_dict()
        for key, value in state["model"].items():
            target = local_part(own[key])
            if target.shape != value.shape:
                raise ValueError(f"{key}: a piece of {tuple(value.shape)} for this worker's {tuple(target.shape)}")
            target.copy_(value)
    load_optimizer_pieces(trainer.optimizer, trainer.params, trainer.names, state["optim"])


def load_optimizer_pieces(
    optimizer: torch.optim.Optimizer, params: list[Any], names: list[str], pieces: dict[str, Any]
) -> None:
    """`optimizer_pieces`' state put into `optimizer` over `params`, cut as those it came from were."""
    from torch.distributed.tensor import DTensor

    from distrain.trainers.optim_state import scalar_placement

    optimizer.state.clear()
    for p, name in zip(params, names, strict=True):
        saved = pieces.get(name) or {}
        entry: dict[str, Any] = {}
        for key, value in saved.items():
            if torch.is_tensor(value) and isinstance(p, DTensor) and value.shape == local_part(p).shape:
                local = value.to(device=local_part(p).device, dtype=value.dtype)
                # the whole shape given: an uneven cut (5 rows over 2) is not the local shape times D
                entry[key] = DTensor.from_local(
                    local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            elif torch.is_tensor(value) and value.dim() == 0:  # Adam's step: where torch keeps it
                entry[key] = torch.tensor(float(value), **scalar_placement(optimizer, p))
            elif torch.is_tensor(value):
                entry[key] = value.to(device=local_part(p).device)
            else:
                entry[key] = value
        if entry:
            optimizer.state[p] = entry


def digest(trainer: ShardedTrainer) -> str:
    """A fingerprint of this worker's parameter pieces (before `shard`: the whole parameters): equal
    digests on worker d of two replicas, equal pieces."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    flat = torch.cat([local_part(p).detach().reshape(-1).float().cpu() for p in params])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]


def whole_state(trainer: ShardedTrainer) -> dict[str, Any]:
    """The replica's whole model and flat optimizer state, gathered from its D workers (every one of them
    calls this at once: a collective inside the replica, none across replicas)."""
    from torch.distributed.tensor import DTensor

    from distrain.trainers.sharded_checkpoint import MODEL, whole_optimizer

    def whole(v: Any) -> Any:
        return v.full_tensor().detach().cpu() if isinstance(v, DTensor) else v.detach().cpu()

    entries = {k: whole(v) for k, v in trainer.checkpoint_entries().items()}
    model = {k: entries[f"{MODEL}/{k}"] for k in trainer.model.state_dict()}
    return {"model": model, "optimizer": whole_optimizer(entries, trainer.names).to_dict()}
