"""Tensor parallelism inside a replica (`--tensor-parallel T`): plans, their checks, and applying them.

A plan names the model's submodules and how each is split across the T workers: "colwise" (a Linear's
output features cut T ways; its input whole) or "rowwise" (its input features cut T ways; the outputs'
partial sums all-reduced), Megatron style: a colwise layer followed by a rowwise one needs no
communication in between. A plan may also hold torch's own `ParallelStyle` objects for other layouts.
Modules the plan does not name stay whole on every worker (they see the same activations, so they
compute the same gradients). torch's `parallelize_module` does the work; distrain writes no sharding.

The task states its plan (`Task.tensor_parallel_plan`); the built-in `mlp` has one (`BUILTIN_PLANS`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from distrain.errors import ConfigError

STYLES = ("colwise", "rowwise")
# The built-in models' plans: the mlp's first Linear column-wise, the second row-wise (the classifier,
# 10 outputs, stays whole).
BUILTIN_PLANS: dict[str, dict[str, str]] = {"mlp": {"1": "colwise", "3": "rowwise"}}


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
        if not isinstance(style, str):
            continue  # torch's own ParallelStyle: checked by torch when the workers apply it
        if style not in STYLES:
            raise ConfigError(f"{flag}: the plan's style {style!r} for {name!r} is not one of {', '.join(STYLES)}")
        if not isinstance(module, nn.Linear):
            raise ConfigError(f"{flag}: {name!r} is a {type(module).__name__}; 'colwise'/'rowwise' split nn.Linear")
        size, what = (module.out_features, "outputs") if style == "colwise" else (module.in_features, "inputs")
        if size % tp:
            raise ConfigError(f"{flag} does not divide {name!r}'s {size} {what} ({style}); pick T that divides it")


def local_params(model: nn.Module, plan: dict[str, Any], tp: int) -> int:
    """Parameter values one of `tp` workers holds under `plan`: a colwise Linear's weight and bias cut
    `tp` ways, a rowwise one's weight (its bias stays whole), a torch style's module counted as cut;
    every module the plan does not name, whole."""
    modules = dict(model.named_modules())
    cut: dict[int, bool] = {}  # id(parameter) -> cut tp ways
    for name, style in plan.items():
        for pname, p in modules[name].named_parameters(recurse=False):
            cut[id(p)] = not (style == "rowwise" and pname == "bias")
    return sum(p.numel() // tp if cut.get(id(p)) else p.numel() for p in model.parameters() if p.requires_grad)


def torch_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan in torch's terms (`parallelize_module`'s parallelize_plan)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    made = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {name: made[style]() if isinstance(style, str) else style for name, style in plan.items()}


def apply_plan(model: nn.Module, plan: dict[str, Any], mesh: Any) -> None:
    """Split `model`'s planned modules over the 1-D mesh of the replica's T tensor-parallel workers."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, torch_plan(plan))
