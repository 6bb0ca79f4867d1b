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
from distrain.trainers.own_optimizer import build_own, restore_scheduler
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
        accumulate_steps: int = 1,
        clip_grad_norm: float = 0.0,
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
        self._in_train_mode = False  # `compute_gradients` has put the model in training mode
        self.last_loss = float("nan")  # the last batch's loss (local SGD's AdaComm reads it)
        self.last_logs: dict[str, float] | None = None  # the task's own scalars of the last batch (see split_loss)
        # The optimizer steps one flat tensor (θ in `params_flat`, its gradient `grads_flat`), as a PS
        # shard steps its slice. Every optimizer distrain runs is element-wise, so each value gets the
        # same update as under a per-tensor step, while a step costs one pass of ~10 kernels instead of
        # ~10 per parameter tensor (the char LM's 30 tensors under Adam: 0.92 ms -> 0.32 ms a step).
        self.flat_param = nn.Parameter(self.params_flat)  # shares params_flat's storage: the views see it
        self.flat_param.grad = self.grads_flat
        self.accumulate_steps = accumulate_steps  # --accumulate-steps: micro-batches per update
        self.clip_grad_norm = clip_grad_norm  # --clip-grad-norm: 0 is off
        # The task's own optimizer (trainers/own_optimizer.py): over the flat tensor when it declares itself
        # element-wise (state in the same flat form as distrain's own), else over the whole tensors.
        flat = task is None or task.elementwise_optimizer  # (some tests' trainers have no task)
        own = None if task is None else build_own(task, [self.flat_param] if flat else self.params)
        self.scheduler = None if own is None else own[1]
        self.own_optimizer = own is not None
        self.opt_params = [self.flat_param] if own is None or flat else self.params
        if own is not None:
            self.optimizer = own[0]
        else:
            self.optimizer = make_optimizer(optimizer, [self.flat_param], lr, momentum, weight_decay, optimizer_args)
        self.applied_lr: float | None = None  # the rate of the last update (the task's own optimizer's)

    @property
    def nbytes(self) -> int:
        return self.numel * self.params_flat.element_size()

    # ------------------------------------------------------------------ the step
    def compute_gradients(self, batch: Any) -> float:
        """Forward and backward of the task's loss on one batch; leaves the gradient in `grads_flat`.
        Under --accumulate-steps k the batch is k micro-batches (`Task.micro_batches`), each loss weighted
        by its share of the samples: `grads_flat` holds the gradient of the whole batch's mean loss."""
        if not self._in_train_mode or not self.model.training:  # a walk over every module: not every step
            self.model.train()  # (again after an evaluation, which leaves the model in eval mode)
            self._in_train_mode = True
        self.grads_flat.zero_()
        batch = to_device(batch, self.device)
        # A batch of n < k samples (a worker's small share under --worker-weights/--balance speed) is n
        # micro-batches of one: weighted by their samples, the gradient is the same, and it fits.
        k = self.accumulate_steps
        if k > 1:
            k = min(k, self.task.batch_size(batch))
        parts = [batch] if k == 1 else self.task.micro_batches(batch, k)
        total = sum(self.task.batch_size(part) for part in parts) if len(parts) > 1 else 1
        loss_sum, logs_sum = 0.0, None
        for i, part in enumerate(parts):
            with autocast(self.precision, self.device):
                loss, logs = split_loss(self.task, self.task.loss(self.model, part))
            loss = loss.float()
            weight = self.task.batch_size(part) / total if len(parts) > 1 else 1.0
            scale = weight * (self.scaler.scale if self.scaler is not None else 1.0)
            scaled = loss if scale == 1.0 else loss * scale  # k = 1 in fp32: the very ops of a plain step
            if i + 1 < len(parts):
                self._accumulate(scaled)
            else:  # the last micro-batch: the backward that strategies' gradient hooks watch
                scaled.backward()
            loss_sum += float(loss.detach()) * weight
            logs_sum = add_logs(logs_sum, logged_values(self.task, logs), weight)
        self._grads_scaled = self.scaler is not None
        self._ensure_grads_in_flat_buffer()
        self.last_loss = loss_sum
        self.last_logs = logs_sum
        return self.last_loss

    def _accumulate(self, loss: torch.Tensor) -> None:
        """Add `loss`'s gradient into `grads_flat` without accumulating into `.grad`: the post-accumulate
        hooks (BSP's overlapped all-reduce, strategies/collective.py) then fire once per update, on the
        last micro-batch's backward, when the buffer holds the whole sum (as DDP's no_sync)."""
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            n = p.numel()
            if g is not None:
                self.grads_flat[offset : offset + n].add_(g.reshape(-1))
            offset += n

    def clip_gradient_(self) -> None:
        """--clip-grad-norm: scale `grads_flat` so its global L2 norm is at most the limit, as
        torch.nn.utils.clip_grad_norm_ does over the model's parameters (one flat tensor: the same norm)."""
        if self.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([self.flat_param], self.clip_grad_norm)

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
        self.clip_gradient_()  # the gradient this update applies: all-reduced under BSP, local elsewhere
        if self.own_optimizer:  # the task's own rates, moved by its own scheduler
            self.applied_lr = float(self.optimizer.param_groups[0]["lr"])
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, batches: Iterable[Any]) -> dict[str, tuple[float, float]]:
        """(sum, count) of the task's loss and metrics over `batches` (see `trainers/task.py`)."""
        return evaluate_model(self.model, self.task, batches, self.precision, self.device)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Model state and the optimizer's state in flat form (transport-independent); fp16's loss scale."""
        state = {"model": self.model_state(), "optimizer": self.flat_optimizer_state().to_dict()}
        if self.scheduler is not None:  # the task's own scheduler's position
            state["scheduler"] = self.scheduler.state_dict()
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
        if self.scheduler is not None and state.get("scheduler"):
            restore_scheduler(self.scheduler, state["scheduler"])

    def flat_optimizer_state(self) -> FlatOptimizerState:
        return export_flat_state(self.optimizer, self.opt_params)

    def load_flat_optimizer_state(self, flat: FlatOptimizerState) -> None:
        import_flat_state(self.optimizer, self.opt_params, flat)


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


def add_logs(total: dict[str, float] | None, values: dict[str, float] | None, weight: float) -> dict[str, float] | None:
    """A micro-batch's own scalars added into the step's, weighted like its loss (--accumulate-steps)."""
    if values is None:
        return total
    return {name: (total or {}).get(name, 0.0) + value * weight for name, value in values.items()}


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
