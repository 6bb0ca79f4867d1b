"""Sharded checkpoints' entries and their whole reading, in one process (no Ray, no process group): a
model and Adam state written as DCP entries read back as the flat form every strategy restores."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from distrain.orchestrator.controller.attempt import Attempt
from distrain.trainers.optim_state import export_flat_state
from distrain.trainers.sharded_checkpoint import (
    MODEL,
    is_complete,
    optimizer_entries,
    read_whole,
    saved_values,
    whole_optimizer,
)


def _stepped() -> tuple[nn.Module, torch.optim.Optimizer, list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 3)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer, [n for n, _ in model.named_parameters()]


def test_optimizer_entries_put_together_are_the_flat_state():
    model, optimizer, names = _stepped()
    entries = optimizer_entries(optimizer, list(model.parameters()), names)
    assert set(entries) == {f"optim/{n}/{k}" for n in names for k in ("exp_avg", "exp_avg_sq")} | {"optim#/step"}
    flat = export_flat_state(optimizer, list(model.parameters()))
    whole = whole_optimizer(entries, names)
    assert whole.scalars == flat.scalars == {"step": 2.0}
    assert all(torch.equal(whole.vectors[k], flat.vectors[k]) for k in flat.vectors)


def test_a_saved_state_reads_back_whole_in_the_model_order(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, optimizer, names = _stepped()
    state = model.state_dict()
    entries = {f"{MODEL}/{k}": v for k, v in state.items()} | optimizer_entries(
        optimizer, list(model.parameters()), names
    )
    dcp.save(entries, checkpoint_id=str(tmp_path / "s"), no_dist=True)
    assert is_complete(tmp_path / "s") and not is_complete(tmp_path / "nothing")
    assert saved_values(tmp_path / "s") == sum(v.numel() for v in state.values() if v.is_floating_point())
    strategy_state = {"strategy": "diloco", "state": {"outer_steps": 3, "outer_optimizer": {"sharded": "optim"}}}
    whole = read_whole(tmp_path / "s", list(state), names, strategy_state)
    assert list(whole["model"]) == list(state)  # DCP's own order is another; the model's is kept
    assert all(torch.equal(whole["model"][k], v) for k, v in state.items())
    flat = export_flat_state(optimizer, list(model.parameters()))
    assert all(torch.equal(whole["optimizer"]["vectors"][k], v) for k, v in flat.vectors.items())
    outer = whole["strategy_state"]["state"]
    assert outer["outer_steps"] == 3 and torch.equal(
        outer["outer_optimizer"]["vectors"]["exp_avg"], flat.vectors["exp_avg"]
    )


def test_the_driver_writes_no_checkpoint_of_a_step_a_worker_saved_non_finite():
    books = SimpleNamespace(nonfinite_shards={8})
    ref = {"dir": "state-00000004", "step": 4, "finite": True}
    assert Attempt._finite(books, {"sharded": ref})
    assert not Attempt._finite(books, {"sharded": ref | {"step": 8}})  # another worker's flag, from its rows
    assert not Attempt._finite(books, {"sharded": ref | {"finite": False}})  # rank 0's own
