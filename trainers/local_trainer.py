"""The local step: one model replica, its optimizer, and flat parameter/gradient buffers.

Parameters and gradients are views into two contiguous buffers (`params_flat`, `grads_flat`), so a
strategy communicates one buffer per step (all-reduce, push/pull) with no per-tensor calls and no
copies. Autograd accumulates into an existing `.grad` in place, which keeps the views attached; the
first backward pass verifies that and the trainer falls back to copying if it ever is not so. The
optimizer steps `params_flat` as one tensor (see `__init__`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from distrain.trainers.optim_state import (
    FlatOptimizerState,
    export_flat_state,
    import_flat_state,
    make_optimizer,
)
from distrain.trainers.precision import LossScaler, autocast
from distrain.trainers.task import Task, to_device


class LocalTrainer:
    def __init__(
        self,
        model: nn.Module,
        task: Task,
        optimizer: str,
        lr: float,
        momentum: float | None,
        weight_decay: float | None,
        device: torch.device | str = "cpu",
        optimizer_args: dict[str, Any] | None = None,
        precision: str = "fp32",
    ) -> None:
        self.device = torch.device(device)
        # --precision: the forward pass's dtype (trainers/precision.py); parameters, gradients and the
        # optimizer stay float32. fp16 scales the loss; the strategy unscales before it uses the gradient.
        self.precision = precision
        self.scaler = LossScaler() if precision == "fp16" else None
        self._grads_scaled = False
        self.model = model.to(self.device)
        self.task = task
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
        self.last_logs: dict[str, float] | None = None  # the task's own scalars of the last batch (see split_loss)
        # The optimizer steps one flat tensor (θ in `params_flat`, its gradient `grads_flat`), as a PS
        # shard steps its slice. Every optimizer distrain runs is element-wise, so each value gets the
        # same update as under a per-tensor step, while a step costs one pass of ~10 kernels instead of
        # ~10 per parameter tensor (the char LM's 30 tensors under Adam: 0.92 ms -> 0.32 ms a step).
        self.flat_param = nn.Parameter(self.params_flat)  # shares params_flat's storage: the views see it
        self.flat_param.grad = self.grads_flat
        self.optimizer = make_optimizer(optimizer, [self.flat_param], lr, momentum, weight_decay, optimizer_args)

    @property
    def nbytes(self) -> int:
        return self.numel * self.params_flat.element_size()

    # ------------------------------------------------------------------ the step
    def compute_gradients(self, batch: Any) -> float:
        """Forward and backward of the task's loss on one batch; leaves the gradient in `grads_flat`."""
        self.model.train()
        self.grads_flat.zero_()
        with autocast(self.precision, self.device):
            loss, logs = split_loss(self.task, self.task.loss(self.model, to_device(batch, self.device)))
        loss = loss.float()
        if self.scaler is not None:
            (loss * self.scaler.scale).backward()
            self._grads_scaled = True
        else:
            loss.backward()
        self._ensure_grads_in_flat_buffer()
        self.last_loss = float(loss.detach())
        self.last_logs = logged_values(self.task, logs)
        return self.last_loss

    def portion_sums(self, batch: Any, with_gradient: bool) -> tuple[float, int]:
        """Full-batch methods (Sandblaster): the loss *summed* over `batch` with the model in eval mode
        (`Task.deterministic_loss`: no dropout, batch-norm running statistics, so every pass over the
        same θ gives the same value) and its sample count; with `with_gradient`, the summed gradient is
        left in `grads_flat`."""
        batch = to_device(batch, self.device)
        n = self.task.batch_size(batch)
        if not with_gradient:
            with torch.no_grad():
                return float(self.task.deterministic_loss(self.model, batch)) * n, n
        self.grads_flat.zero_()
        loss = self.task.deterministic_loss(self.model, batch)
        (loss * n).backward()
        self._ensure_grads_in_flat_buffer()
        return float(loss.detach()) * n, n

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

    def unscale_grads_(self) -> None:
        """fp16: divide `grads_flat` by the loss scale, once per backward (a no-op otherwise). Strategies
        call it where they take the gradient into use: after the all-reduce under BSP (the buckets were
        all-reduced scaled, during backward), before the push or local step elsewhere."""
        if self._grads_scaled:
            assert self.scaler is not None
            self.grads_flat.mul_(1.0 / self.scaler.scale)
            self._grads_scaled = False

    def apply_update(self, lr: float) -> None:
        """One optimizer step with `grads_flat` (already averaged by the strategy) at rate `lr`."""
        self.unscale_grads_()  # a strategy that never unscaled (a plugin's) still steps with the true gradient
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, batches: Iterable[Any]) -> dict[str, tuple[float, float]]:
        """(sum, count) of the task's loss and metrics over `batches` (see `trainers/task.py`)."""
        return evaluate_model(self.model, self.task, batches, self.precision, self.device)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Model state and the optimizer's state in flat form (transport-independent); fp16's loss scale."""
        state = {"model": self.model_state(), "optimizer": self.flat_optimizer_state().to_dict()}
        return state | self.scaler_state()

    def scaler_state(self) -> dict[str, Any]:
        """{"scaler": ...} under fp16 (part of every checkpoint), else nothing."""
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict as compact copies. The parameters are views of `params_flat`, and a
        view pickles (Ray) with its whole underlying buffer: a checkpoint of the views held one copy of
        every parameter per parameter tensor (a 0.6 MB cnn's final.pt was 5.5 MB, resnet18's 2.8 GB)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])  # copies in place: the flat views stay attached
        self.load_flat_optimizer_state(FlatOptimizerState.from_dict(state["optimizer"]))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def flat_optimizer_state(self) -> FlatOptimizerState:
        return export_flat_state(self.optimizer, [self.flat_param])

    def load_flat_optimizer_state(self, flat: FlatOptimizerState) -> None:
        import_flat_state(self.optimizer, [self.flat_param], flat)


def split_loss(task: Task, returned: Any) -> tuple[torch.Tensor, Any]:
    """What the task's `loss` returned, as (the scalar loss, its own scalars or None). A task logs values
    of its own per step by returning `(loss, {"name": value})`; they reach the metrics as `train_<name>`
    columns and every logger. A plain tensor (the usual case) costs one type check."""
    if type(returned) is tuple and len(returned) == 2:
        return scalar_loss(task, returned[0]), returned[1]
    return scalar_loss(task, returned), None


def logged_values(task: Task, logs: Any) -> dict[str, float] | None:
    """The task's own scalars (the dict `split_loss` found) as floats, checked; None when it logged none.
    Read after the backward pass, so a tensor value's host copy waits for nothing the step still needs."""
    if logs is None:
        return None
    if not isinstance(logs, dict) or not all(isinstance(k, str) and k for k in logs):
        raise TypeError(
            f"{type(task).__name__}.loss returned a (loss, logs) pair whose logs are {type(logs).__name__}; "
            "they must be a dict {name: number}"
        )
    try:
        return {name: float(value.detach() if torch.is_tensor(value) else value) for name, value in logs.items()}
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"{type(task).__name__}.loss returned logs that are not all numbers (one scalar per name)"
        ) from None


def scalar_loss(task: Task, loss: Any) -> torch.Tensor:
    """`loss` as the task's `loss` returned it, refused (TypeError, naming the task) unless a scalar tensor."""
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise TypeError(f"{type(task).__name__}.loss must return a scalar tensor, got {shape}")
    return loss


@torch.no_grad()
def evaluate_model(
    model: nn.Module, task: Task, batches: Iterable[Any], precision: str, device: torch.device
) -> dict[str, tuple[float, float]]:
    """(sum, count) of the task's loss and metrics of `model` over `batches` (see `trainers/task.py`)."""
    model.eval()
    totals: dict[str, tuple[float, float]] = {}
    for batch in batches:
        with autocast(precision, device):
            scores = task.evaluate_batch(model, to_device(batch, device))
        for name, (s, c) in scores.items():
            before = totals.get(name, (0.0, 0.0))
            totals[name] = (before[0] + s, before[1] + c)
    return totals
