"""The local step of a cut replica: torch's FSDP2 holds 1/D of the model on each worker (`--fsdp D`),
after tensor parallelism has split the task's planned layers T ways (`--tensor-parallel T`).

The worker builds the whole model from the run's seed, as every worker does, so the D workers of a
replica start from the same values; `shard` then hands it to `fully_shard` over the run's device mesh
(("replicate", "shard") = (R, D): HSDP, a reduce-scatter of each layer's gradient inside the replica and
an all-reduce of the shards across replicas) and keeps only this worker's shard. Parameters, gradients
and optimizer state are DTensors from then on; the optimizer steps them per tensor (every optimizer
distrain runs is element-wise, so a shard's update is the whole tensor's update, cut).

Under a hybrid tensor-parallel plan (the cnn's: each of the T workers on its own samples, only the
classifier split) `HybridGradients` scales the loss and sums the convolutions' gradients over the T
workers, so every gradient is the mean over their T x B samples.

--precision bf16|fp16 (trainers/precision.py's rule: compute in the low dtype, keep parameters, gradients,
optimizer state and everything reduced in float32): where FSDP cuts the model, its own
`MixedPrecisionPolicy` (`mixed_precision_policy`) gathers each layer's parameters in the low dtype and
runs the layer in it, and reduces the gradients in float32 into the float32 shards the optimizer steps
(batch norm with running statistics: a float32 unit of its own, `norm_policy`);
where it does not (tensor parallelism alone, a replica of one data-parallel worker), the forward runs
under `torch.autocast`, as a plain worker's does, DTensors included. fp16 scales the loss with
LocalTrainer's `LossScaler`; the strategy unscales and takes the skip decision on the reduced gradient,
one decision for every worker of the run (strategies/sharded_bsp.py `step`).

Checkpoints: each worker writes its own shards through torch.distributed.checkpoint
(`checkpoint_entries`, trainers/sharded_checkpoint.py) and reads its own pieces back at any D or T
(`load_state_dict` with a {"sharded": directory} reference); a whole (layout-free) state, such as an
unsharded run's checkpoint, loads too, each worker cutting its shard out of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distrain.trainers.local_trainer import add_logs, evaluate_model, logged_values, split_loss
from distrain.trainers.optim_state import (
    FlatOptimizerState,
    import_flat_state,
    make_optimizer,
)
from distrain.trainers.own_optimizer import build_own
from distrain.trainers.precision import DTYPES, LossScaler, autocast
from distrain.trainers.task import Task, to_device


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` wraps one by one before the root (each gathers its parameters just
    before it runs and frees them after): the root's children that hold parameters, descending into
    containers that are never called themselves (ModuleList, ModuleDict)."""
    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            units += fsdp_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


class ShardedTrainer:
    """`LocalTrainer`'s part for a sharded replica (the worker and `ShardedBSP` use these members)."""

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
        self.precision = precision
        # fp16's loss scale: the same `LossScaler` as a plain worker's; every worker of the run updates it
        # on the same decision (`Strategy.gradient_decision`), so all hold the same scale.
        self.scaler = LossScaler() if precision == "fp16" else None
        self._grads_scaled = False
        # Whether the forward runs under torch.autocast (`shard` turns it off where FSDP's policy casts).
        self.autocast_forward = precision != "fp32"
        self.accumulate_steps = accumulate_steps  # --accumulate-steps: micro-batches per update
        self.clip_grad_norm = clip_grad_norm  # --clip-grad-norm: 0 is off
        self.model = model.to(self.device)
        self.task = task
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._optimizer_spec = (optimizer, lr, momentum, weight_decay, optimizer_args)
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending_optimizer: FlatOptimizerState | None = None  # a checkpoint's, until `shard`
        self.loaded_from: Path | None = None  # the sharded checkpoint this worker started from, if any
        self._pending_dir: Path | None = None  # that checkpoint, until `shard` has cut the model
        self.last_loss = float("nan")
        self.last_logs: dict[str, float] | None = None  # the task's own scalars (local_trainer.split_loss)
        self.hybrid: HybridGradients | None = None
        self.own_optimizer, self.scheduler = False, None  # set by `shard`, with the optimizer
        self.tp_rank = 0  # this worker's tensor-parallel rank (set by `shard`)
        self.applied_lr: float | None = None  # the rate of the last update (the task's own optimizer's)
        self._pending_scheduler: dict[str, Any] | None = None  # a checkpoint's, until `shard` builds the scheduler
        self._checkpoint_keys: dict[str, list[str]] | None = None  # `checkpoint_keys`, once the model is cut

    # ------------------------------------------------------------------ sharding
    def shard(
        self, mesh: Any, reshard_after_forward: bool = True, across_replicas: bool = True, own_samples: bool = False
    ) -> None:
        """Cut the model over `mesh`, ("replicate", "shard", "tp") = (R, D, T) (every worker of the run
        calls this at once): the task's plan over "tp", then FSDP over the data-parallel workers (those of
        every replica, HSDP; or, without `across_replicas`, the replica's own: each replica steps alone),
        and make the optimizer over this worker's parts. `own_samples`: the plan is a hybrid, each of the
        T workers steps on its own samples (`HybridGradients`)."""
        from torch.distributed.fsdp import fully_shard

        from distrain.trainers.tensor_parallel import apply_plan

        forget_earlier_meshes()
        self._checkpoint_keys = None
        tp = mesh["tp"].size()
        self.tp_rank = mesh["tp"].get_local_rank()
        if tp > 1:  # the plan was checked on the whole model before the run started (orchestrator/run_checks.py)
            # A pipeline stage holds some of the model's layers (under their own names): it splits those.
            here = dict(self.model.named_modules())
            plan = {name: style for name, style in (self.task.tensor_parallel_plan(tp) or {}).items() if name in here}
            if plan:
                apply_plan(self.model, plan, mesh["tp"])
        self.hybrid = HybridGradients(self.model, mesh["tp"]) if own_samples and tp > 1 else None
        self.tp_numel = sum(local_part(p).numel() for p in self.model.parameters() if p.requires_grad)
        dp = mesh["replicate", "shard"] if across_replicas else mesh["shard"]
        if dp.size() > 1:
            policy = mixed_precision_policy(self.precision)
            # Batch norm under --precision: its own unit, run in float32 (`norm_policy`), first (innermost).
            norms = running_stat_norms(self.model) if self.precision != "fp32" else []
            for norm in norms:
                fully_shard(norm, mesh=dp, reshard_after_forward=reshard_after_forward, mp_policy=norm_policy(policy))
            for unit in fsdp_units(self.model):
                if unit in norms:  # (a root child that is one: cut already)
                    continue
                fully_shard(unit, mesh=dp, reshard_after_forward=reshard_after_forward, mp_policy=policy)
            fully_shard(self.model, mesh=dp, reshard_after_forward=reshard_after_forward, mp_policy=policy)
            self.autocast_forward = False  # FSDP's policy casts the layers; autocast on top would recast ops
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]  # the checkpoints' keys for the optimizer state
        self.params = [p for _, p in named]
        name, lr, momentum, weight_decay, args = self._optimizer_spec
        own = build_own(self.task, self.params)  # the task's own optimizer over this worker's DTensor shards
        self.own_optimizer, self.scheduler = own is not None, None if own is None else own[1]
        self.optimizer = (
            own[0] if own is not None else make_optimizer(name, self.params, lr, momentum, weight_decay, args)
        )
        if self._pending_optimizer is not None:
            self._import_optimizer(self._pending_optimizer)
            self._pending_optimizer = None
        if self._pending_dir is not None:
            self._load_sharded(self._pending_dir)
            self._pending_dir = None
        if self._pending_scheduler is not None:
            self._restore_scheduler(self._pending_scheduler)
            self._pending_scheduler = None

    def whole_flat(self) -> torch.Tensor:
        """The trainable parameters flat, in order, on the CPU: before `shard` (the whole model), for the
        PS shards to start from (strategies/sharded_ps.py)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if any(local_part(p) is not p for p in params):
            raise RuntimeError("whole_flat: the model is cut already")
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in params])

    @property
    def nbytes(self) -> int:
        """Parameter bytes this worker holds: its shards once sharded (the whole model before)."""
        return sum(local_part(p).numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def grad_bytes(self) -> int:
        return sum(local_part(p.grad).numel() * p.grad.element_size() for p in self.params if p.grad is not None)

    # ------------------------------------------------------------------ the step
    def compute_gradients(self, batch: Any, loss_weight: float = 1.0) -> float:
        """Forward and backward of the task's loss on this worker's batch; FSDP leaves each shard's
        gradient averaged over the replica's D workers (and, across replicas, over all of them).
        `loss_weight` 0: a worker with no unit in an elastic round still runs FSDP's collectives, adding
        a zero gradient (strategies/elastic_cut.py)."""
        assert self.optimizer is not None, "shard() comes first"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        batch = to_device(batch, self.device)
        # --accumulate-steps k: k micro-batches, each loss weighted by its share of the samples; FSDP
        # reduces (reduce-scatter, and HSDP's all-reduce) only in the last one's backward, as its no_sync.
        parts = [batch] if self.accumulate_steps == 1 else self.task.micro_batches(batch, self.accumulate_steps)
        total = sum(self.task.batch_size(part) for part in parts)
        loss_sum, logs_sum = 0.0, None
        for i, part in enumerate(parts):
            if len(parts) > 1 and hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(i + 1 == len(parts))
            with autocast(self.precision if self.autocast_forward else "fp32", self.device):
                loss, logs = split_loss(self.task, self.task.loss(self.model, part))
            weight = self.task.batch_size(part) / total if len(parts) > 1 else 1.0
            factor = weight * loss_weight * (self.scaler.scale if self.scaler is not None else 1.0)  # fp16: scaled
            scaled = loss.float() if factor == 1.0 else loss.float() * factor
            (scaled if self.hybrid is None else self.hybrid.scale(scaled)).backward()
            loss_sum += float(loss.detach()) * weight
            logs_sum = add_logs(logs_sum, logged_values(self.task, logs), weight)
        if self.hybrid is not None:
            self.hybrid.sum_whole(self.model)
        self._grads_scaled = self.scaler is not None
        self.last_loss = loss_sum
        self.last_logs = logs_sum
        return self.last_loss

    def clip_gradient_(self, group: Any = None, limit: float | None = None) -> None:
        """--clip-grad-norm (or `limit`) over the gradient one update applies, whose pieces the workers of
        `group` hold (None: the run's): trainers/cut_gradient_norm.py counts each element once across
        FSDP shards, tensor-parallel splits and the tensors the T workers hold alike. A collective: every
        worker of `group` calls it, finite or not."""
        from distrain.trainers.cut_gradient_norm import clip_cut_gradient_

        limit = self.clip_grad_norm if limit is None else limit
        if limit > 0:
            clip_cut_gradient_([p.grad for p in self.params if p.grad is not None], limit, group, self.tp_rank)

    def local_grad_sum(self) -> torch.Tensor:
        """The sum of this worker's gradient shards (NaN or inf if any value is), for the run-wide check."""
        return local_sum(p.grad for p in self.params if p.grad is not None)

    def unscale_grads_(self) -> None:
        """fp16: divide this worker's gradient pieces by the loss scale, once per backward (a no-op
        otherwise). The strategy calls it on the reduced gradient, before it clips or checks it."""
        if self._grads_scaled:
            assert self.scaler is not None
            inverse = 1.0 / self.scaler.scale
            for p in self.params:
                if p.grad is not None:
                    local_part(p.grad).mul_(inverse)
            self._grads_scaled = False

    def apply_update(self, lr: float) -> None:
        assert self.optimizer is not None
        self.unscale_grads_()  # (a strategy that never unscaled still steps with the true gradient)
        if self.own_optimizer:  # the task's own optimizer keeps its own rates (trainers/own_optimizer.py)
            self.applied_lr = float(self.optimizer.param_groups[0]["lr"])  # the step row's lr column
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def evaluate(self, batches: Iterable[Any]) -> dict[str, tuple[float, float]]:
        return evaluate_model(self.model, self.task, batches, self.precision, self.device)

    # ------------------------------------------------------------------ state
    def scaler_state(self) -> dict[str, Any]:
        """{"scaler": ...} under fp16 (the same on every worker: the driver keeps rank 0's), else nothing."""
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def checkpoint_entries(self) -> dict[str, torch.Tensor]:
        """This worker's pieces of the model and optimizer state, as DCP entries (no copy, no collective)."""
        from distrain.trainers.sharded_checkpoint import MODEL, optimizer_entries

        assert self.optimizer is not None
        entries = {f"{MODEL}/{k}": v for k, v in self.model.state_dict().items()}
        return entries | optimizer_entries(self.optimizer, self.params, self.names)

    def checkpoint_keys(self) -> dict[str, list[str]]:
        """The model's state dict keys and its trainable parameters' names, in order (a reader of the
        shards in one process puts the state back in this order: DCP's own is another)."""
        if self._checkpoint_keys is None:  # fixed once the model is cut; its state_dict runs FSDP's hooks
            self._checkpoint_keys = {"model_keys": list(self.model.state_dict()), "param_names": list(self.names)}
        return {k: list(v) for k, v in self._checkpoint_keys.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A sharded checkpoint ({"sharded": {"path": directory}}: each worker reads its own pieces, once
        the model is cut) or a whole (layout-free) state: before `shard` into the model as it is, after
        it into each shard."""
        if self.scaler is not None and state.get("scaler"):  # fp16's loss scale, beside either form
            self.scaler.load_state_dict(state["scaler"])
        # A task's own scheduler's position: in the shards' reference, or beside a whole state.
        scheduler = state["sharded"].get("scheduler") if "sharded" in state else state.get("scheduler")
        if self.optimizer is None:
            self._pending_scheduler = scheduler
        if "sharded" in state:
            directory = Path(state["sharded"]["path"])
            self.loaded_from = directory
            if self.optimizer is None:
                self._pending_dir = directory
            else:
                self._load_sharded(directory)
                self._restore_scheduler(scheduler)
            return
        flat = FlatOptimizerState.from_dict(state["optimizer"])
        if self.optimizer is None:
            self.model.load_state_dict(state["model"])
            self._pending_optimizer = flat
            return
        with torch.no_grad():
            own = self.model.state_dict()
            for key, value in state["model"].items():
                local_part(own[key]).copy_(local_part(shard_of(value, own[key])))
        self._import_optimizer(flat)
        self._restore_scheduler(scheduler)

    def scheduler_state(self) -> dict[str, Any]:
        """{"scheduler": its state} where the task's own scheduler runs (the same on every worker), else {}."""
        return {"scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {}

    def _restore_scheduler(self, state: dict[str, Any] | None) -> None:
        if self.scheduler is not None and state:
            from distrain.trainers.own_optimizer import restore_scheduler

            restore_scheduler(self.scheduler, state)

    def _load_sharded(self, directory: Path) -> None:
        """Every worker of the run at once: its pieces of the model and optimizer state (DCP reshards)."""
        from distrain.trainers.sharded_checkpoint import load_model_entries, load_optimizer_entries

        assert self.optimizer is not None
        load_model_entries(self.model, directory)
        load_optimizer_entries(self.optimizer, self.params, self.names, directory)

    def _import_optimizer(self, flat: FlatOptimizerState) -> None:
        assert self.optimizer is not None
        import_flat_state(self.optimizer, self.params, flat, place=shard_of)


class HybridGradients:
    """Under a hybrid tensor-parallel plan (trainers/tensor_parallel.py `takes_own_samples`), makes every
    gradient the mean over the T workers' T x B samples, as one process's on the whole batch.

    Each worker's loss is the mean over its own B samples. Backward through the split layers sees all T
    workers' losses at once (their activations were gathered), so a split parameter's gradient is the
    sum of the T means; a whole (convolution) parameter's, reduce-scattered back to its worker's
    samples, is that worker's mean alone. So the loss is divided by T before backward (`scale`; the
    recorded loss stays the mean) and the whole parameters' gradients are then summed over the T
    workers (`sum_whole`): both the mean over T x B. Under FSDP a whole parameter's gradient is this
    worker's shard over the data-parallel mesh, cut alike on each of the T workers, so its local parts
    are summed."""

    def __init__(self, model: nn.Module, tp_mesh: Any) -> None:
        """Call after the plan is applied and before FSDP: the split parameters are the DTensors then (FSDP
        keeps the parameters' names)."""
        from torch.distributed.tensor import DTensor

        self.tp = tp_mesh.size()
        self.group = tp_mesh.get_group()
        self.whole = [name for name, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss / self.tp

    def sum_whole(self, model: nn.Module) -> None:
        """Sum the whole parameters' gradients (their local parts) over the T workers, in one collective."""
        import torch.distributed as dist

        params = dict(model.named_parameters())
        grads = [local_part(params[name].grad) for name in self.whole if params[name].grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(summed.view_as(grad))

    def numel(self, model: nn.Module) -> int:
        """Values this worker sums over the T workers per step: its parts of the whole parameters."""
        params = dict(model.named_parameters())
        return sum(local_part(params[name]).numel() for name in self.whole)


def mixed_precision_policy(precision: str) -> Any:
    """FSDP2's mixed precision for --precision: parameters gathered and layers run in bf16 or fp16, the
    root's output cast back to float32 (the task's loss is computed in float32, as autocast computes a
    plain worker's cross-entropy), gradients reduced in float32. The reduction stays float32 because it
    sums the gradients of R x D workers: bf16 keeps 8 significant bits, so every partial sum would be
    rounded to about 3 decimal digits (small gradients added to large ones vanish), and fp16's sum of
    finite values could overflow; and everything reduced or sent stays float32 under --precision, as on
    a plain worker. The sharded parameters, their
    gradients and the optimizer's state stay float32 (FSDP keeps the shards in the parameters' dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    low = DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)


def running_stat_norms(model: nn.Module) -> list[nn.Module]:
    """The batch-norm layers that keep running statistics (float32 buffers, which FSDP's policy does not
    cast): under the policy's bf16/fp16 parameters torch's batch_norm refuses them ("expected scalar type
    BFloat16 but found Float"), so each becomes a unit of its own with `norm_policy`."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def norm_policy(policy: Any) -> Any:
    """A batch-norm unit's policy: its parameters and input in float32, as its running statistics are, its
    output back in the run's low dtype for the layers after it (their unit's parameters are), float32
    reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = policy.param_dtype
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=low)


def forget_earlier_meshes() -> None:
    """Clear DTensor's sharding caches before a run cuts its model. A warm worker's earlier run made meshes
    equal to this run's (DeviceMesh equality ignores the process groups), so the caches would hand back
    output specs on those meshes, whose groups that run destroyed ("Could not resolve the process group
    registered under the name 8" when the earlier run had made more groups) and whose coordinates were
    that run's rank's (torch.distributed.checkpoint then files a shard under another shard's offsets)."""
    from torch.distributed.tensor import _redistribute, debug

    # Private to torch (no public way to clear them): each looked up, so a later torch that moves one
    # costs the warm-worker fix, not the run.
    transforms = getattr(_redistribute, "_gen_transform_infos", None)
    for clear in (
        getattr(debug, "_clear_sharding_prop_cache", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(transforms, "cache_clear", None),
    ):
        if clear is not None:
            clear()


def local_sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of this worker's parts of `tensors`, on the CPU (NaN or inf if any value is).
    Summed where they live and moved once: on a GPU, one copy to the host rather than one per tensor."""
    parts = [local_part(t.detach()).double().sum() for t in tensors]
    return torch.stack(parts).sum().cpu() if parts else torch.zeros((), dtype=torch.float64)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This worker's piece of a DTensor; a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def shard_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`whole` cut as `like` is cut (a DTensor: this worker's shard of it, taken without communication,
    since every worker holds the whole value); a plain copy otherwise."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole = whole.detach().to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
    return whole.clone()
