"""The local step: one model replica, its optimizer, and flat parameter/gradient buffers.

Parameters and gradients are views into two contiguous buffers (`params_flat`, `grads_flat`), so a
strategy communicates one buffer per step (all-reduce, push/pull) with no per-tensor calls and no
copies. Autograd accumulates into an existing `.grad` in place, which keeps the views attached; the
first backward pass verifies that and the trainer falls back to copying if it ever is not so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distrain.trainers.datasets import LoadedDataset
from distrain.trainers.optim_state import (
    FlatOptimizerState,
    export_flat_state,
    import_flat_state,
    make_optimizer,
)


@dataclass
class EvalResult:
    loss_sum: float
    correct: int
    count: int


class LocalTrainer:
    def __init__(
        self,
        model: nn.Module,
        data: LoadedDataset,
        optimizer: str,
        lr: float,
        momentum: float | None,  # None for optimizers without momentum (RunConfig gives sgd its 0.9)
        weight_decay: float,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.data = data
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        dtype = self.params[0].dtype
        self.params_flat = torch.empty(self.numel, dtype=dtype, device=self.device)
        self.grads_flat = torch.zeros(self.numel, dtype=dtype, device=self.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            self.params_flat[offset : offset + n].copy_(p.detach().view(-1))
            p.data = self.params_flat[offset : offset + n].view_as(p)
            p.grad = self.grads_flat[offset : offset + n].view_as(p)
            offset += n
        self._grads_are_views: bool | None = None
        self.last_loss = float("nan")  # the last batch's loss (local SGD's AdaComm reads it)
        self.optimizer = make_optimizer(optimizer, self.params, lr, momentum, weight_decay)
        self.loss_fn = nn.CrossEntropyLoss()

    @property
    def nbytes(self) -> int:
        return self.numel * self.params_flat.element_size()

    # ------------------------------------------------------------------ the step
    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward on one batch; leaves the batch-mean gradient in `grads_flat`."""
        self.model.train()
        self.grads_flat.zero_()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self._ensure_grads_in_flat_buffer()
        self.last_loss = float(loss.detach())
        return self.last_loss

    def _ensure_grads_in_flat_buffer(self) -> None:
        if self._grads_are_views is None:
            base = self.grads_flat.data_ptr()
            end = base + self.grads_flat.numel() * self.grads_flat.element_size()
            self._grads_are_views = all(p.grad is not None and base <= p.grad.data_ptr() < end for p in self.params)
        if not self._grads_are_views:
            torch.cat([p.grad.reshape(-1) for p in self.params], out=self.grads_flat)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = self.grads_flat[offset : offset + n].view_as(p)
                offset += n
            self._grads_are_views = None  # re-check next step

    def apply_update(self, lr: float) -> None:
        """One optimizer step with `grads_flat` (already averaged by the strategy) at rate `lr`."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, batch_size: int = 512, shard: int = 0, num_shards: int = 1) -> EvalResult:
        self.model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        for x, y in self.data.test_batches(batch_size, shard, num_shards):
            x, y = x.to(self.device), y.to(self.device)
            logits = self.model(x)
            loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
            count += int(y.numel())
        return EvalResult(loss_sum, correct, count)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Model state and the optimizer's state in flat form (transport-independent)."""
        return {"model": self.model.state_dict(), "optimizer": self.flat_optimizer_state().to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])  # copies in place: the flat views stay attached
        self.load_flat_optimizer_state(FlatOptimizerState.from_dict(state["optimizer"]))

    def flat_optimizer_state(self) -> FlatOptimizerState:
        return export_flat_state(self.optimizer, self.params)

    def load_flat_optimizer_state(self, flat: FlatOptimizerState) -> None:
        import_flat_state(self.optimizer, self.params, flat)
