"""Tensor parallelism inside a replica (`--tensor-parallel T`): plans, their checks, and applying them.

A plan names the model's submodules and how each is split across the T workers: "colwise" (a Linear's
output features cut T ways; its input whole) or "rowwise" (its input features cut T ways; the outputs'
partial sums all-reduced), Megatron style: a colwise layer followed by a rowwise one needs no
communication in between. A plan may also hold torch's own `ParallelStyle` objects for other layouts.
Modules the plan does not name stay whole on every worker (they see the same activations, so they
compute the same gradients). torch's `parallelize_module` does the work; distrain writes no sharding.

The task states its plan (`Task.tensor_parallel_plan`); the built-in `mlp` and `cnn` have one
(`BUILTIN_PLANS`). The cnn's is the hybrid of Krizhevsky 2014 ("one weird trick"): its convolutions stay
data-parallel, each of the T workers running them on its own samples, and only its classifier is split:
the first Linear takes its input batch-sharded (`input_layouts=Shard(0)`: torch all-gathers the T
workers' activations in forward and reduce-scatters their gradients back to each sample's worker in
backward), the last hands each worker its own samples' logits (`output_layouts=Shard(0)`). Such a plan
`takes_own_samples`; the run's batch arithmetic knows it by the model's name (trainers/builtin_names.py
`tp_sample_ranks`, without torch), and trainers/sharded_trainer.py's `HybridGradients` makes the
gradients those of one process.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from distrain.errors import ConfigError

STYLES = ("colwise", "rowwise")
# The built-in models' plans: the mlp's first Linear column-wise, the second row-wise (the classifier,
# 10 outputs, stays whole). The cnn's hybrid: its hidden Linear (1024 -> 128) column-wise on the T
# workers' gathered samples, its classifier (128 -> 10) row-wise, scattered back to each worker's own
# samples; T must divide 128 (the 10 classes need not divide).
BUILTIN_PLANS: dict[str, dict[str, Any]] = {
    "mlp": {"1": "colwise", "3": "rowwise"},
    "cnn": {"6": ColwiseParallel(input_layouts=Shard(0)), "8": RowwiseParallel(output_layouts=Shard(0))},
}


def style_name(style: Any) -> str | None:
    """ "colwise" or "rowwise" for a plan's style named so or given as torch's Colwise/RowwiseParallel
    (whatever their layouts: the weight is cut the same way), None for another torch style."""
    if isinstance(style, str):
        return style
    return {ColwiseParallel: "colwise", RowwiseParallel: "rowwise"}.get(type(style))


def takes_own_samples(plan: dict[str, Any] | None) -> bool:
    """Whether `plan` is a hybrid: some layer takes its input sharded on the batch dimension, so each of
    the T workers feeds its own samples (the T workers of a data-parallel rank do not share a slice)."""
    return any(Shard(0) in getattr(style, "input_layouts", ()) for style in (plan or {}).values())


def plan_of(task: Any, tp: int, who: str) -> dict[str, Any] | None:
    """The task's plan for `tp` workers; its ValueError (a refusal of this tp) as one ConfigError line."""
    try:
        return task.tensor_parallel_plan(tp)
    except ValueError as e:
        raise ConfigError(f"--tensor-parallel {tp} does not fit {who}: {e}") from None


def check_plan(model: nn.Module, plan: dict[str, Any] | None, tp: int, who: str) -> None:
    """Refuse, in one line naming --tensor-parallel, a plan that cannot split `model` T ways: none at all,
    a name the model does not have, a style not known, or a split dimension T does not divide."""
    flag = f"--tensor-parallel {tp}"
    if not plan:
        raise ConfigError(
            f"{flag} needs a tensor-parallel plan and {who} has none; define Task.tensor_parallel_plan() "
            "(module name -> 'colwise' or 'rowwise'), or drop --tensor-parallel"
        )
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules.get(name)
        if module is None:
            raise ConfigError(f"{flag}: the plan names {name!r}, which {who}'s model does not have")
        if isinstance(style, str) and style not in STYLES:
            raise ConfigError(f"{flag}: the plan's style {style!r} for {name!r} is not one of {', '.join(STYLES)}")
        style = style_name(style)
        if style is None:
            continue  # another of torch's ParallelStyles: checked by torch when the workers apply it
        if not isinstance(module, nn.Linear):
            raise ConfigError(f"{flag}: {name!r} is a {type(module).__name__}; 'colwise'/'rowwise' split nn.Linear")
        size, what = (module.out_features, "outputs") if style == "colwise" else (module.in_features, "inputs")
        if size % tp:
            raise ConfigError(f"{flag} does not divide {name!r}'s {size} {what} ({style}); pick T that divides it")


def local_params(model: nn.Module, plan: dict[str, Any], tp: int) -> int:
    """Parameter values one of `tp` workers holds under `plan` (`local_part_shapes`)."""
    return sum(math.prod(shape) for shape in local_part_shapes(model, plan, tp))


def local_part_shapes(model: nn.Module, plan: dict[str, Any], tp: int) -> list[tuple[int, ...]]:
    """The shapes of one of `tp` workers' parts of the model's trainable parameters under `plan`, in
    order: a colwise Linear's weight and bias cut `tp` ways along their rows (dim 0), a rowwise one's
    weight along its columns (its bias stays whole), another torch style's module counted as cut along
    dim 0; every module the plan does not name, whole (`cut_dims`)."""
    shapes = []
    for p, dim in zip((p for p in model.parameters() if p.requires_grad), cut_dims(model, plan), strict=True):
        shape = list(p.shape)
        if dim is not None and len(shape) > dim:
            shape[dim] //= tp
        shapes.append(tuple(shape))
    return shapes


def cut_dims(model: nn.Module, plan: dict[str, Any]) -> list[int | None]:
    """For each of the model's trainable parameters, in order, the dimension `plan` splits it along
    across the T workers (a colwise Linear's weight and bias: 0; a rowwise one's weight: 1; another
    torch style's parameters: counted as 0), or None for one every worker holds whole (a rowwise
    Linear's bias, every module the plan does not name)."""
    modules = dict(model.named_modules())
    cut: dict[int, int] = {}  # id(parameter) -> the dimension cut tp ways
    for name, style in plan.items():
        for pname, p in modules[name].named_parameters(recurse=False):
            if style_name(style) != "rowwise":
                cut[id(p)] = 0
            elif pname != "bias":
                cut[id(p)] = 1
    return [cut.get(id(p)) for p in model.parameters() if p.requires_grad]


def torch_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan in torch's terms (`parallelize_module`'s parallelize_plan)."""
    made = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {name: made[style]() if isinstance(style, str) else style for name, style in plan.items()}


def apply_plan(model: nn.Module, plan: dict[str, Any], mesh: Any) -> None:
    """Split `model`'s planned modules over the 1-D mesh of the replica's T tensor-parallel workers."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, torch_plan(plan))

