"""Small helpers shared by the tests that start real runs."""

from __future__ import annotations

from pathlib import Path

import torch

from distrain.orchestrator.checkpoint import load_checkpoint


def final_params(run_dir: Path) -> torch.Tensor:
    """The final model parameters of a run, flattened in the model's parameter order."""
    state = load_checkpoint(Path(run_dir) / "checkpoints" / "final.pt")["model"]
    return torch.cat([t.reshape(-1).double() for t in state.values()])
