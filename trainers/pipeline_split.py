"""Cutting a model into pipeline stages (no communication: `strategies/pipeline.py` runs them).

A pipeline-able model is an `nn.Sequential` (its top-level children run one after the other). It may be
cut before any child the task's `split_points()` names, or, where the task names none, before any child
but the first. Of those places, the S - 1 cuts are chosen to balance the stages' parameter counts
(minimising the largest stage's count): parameters, gradients and optimizer state are what a stage
must hold whatever the micro-batch size, so they are what decides whether a model fits its workers.
Balancing by measured time would need a timed pass of every child on a real batch before the run, and
is left out (see docs/architecture.md, "Pipelines").

A stage is an `nn.Sequential` of its children under their original names, so its state dict's keys are
the full model's, and its parameters are a contiguous run of the full model's in the same order: the
stages' flat parameter (and optimizer state) vectors, concatenated in stage order, are the full
model's. That is what lets a checkpoint hold one full state dict and restore to any S.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import nn

from distrain.errors import ConfigError


@dataclass(frozen=True)
class StagePlan:
    """Where the model is cut: `bounds[s]` = (first child, one past the last child) of stage s."""

    children: tuple[str, ...]  # the Sequential's child names, in order
    sizes: tuple[int, ...]  # trainable parameter values of each child
    bounds: tuple[tuple[int, int], ...]

    @property
    def stages(self) -> int:
        return len(self.bounds)

    def stage_params(self, stage: int) -> int:
        lo, hi = self.bounds[stage]
        return sum(self.sizes[lo:hi])

    def offset(self, stage: int) -> int:
        """Where stage `stage`'s parameters start in the full model's flat parameter vector."""
        return sum(self.stage_params(s) for s in range(stage))


class StageCutError(ConfigError):
    """The model cannot be cut into the stages asked for. `detail` continues the name of the flag that asked,
    which the pipeline strategy gives (strategies/pipeline.py `plan_stages_for`): trainers know no flags."""

    def __init__(self, detail: str) -> None:
        super().__init__("pipeline" + detail)
        self.detail = detail


def cut_candidates(model: nn.Module, split_points: list[str]) -> list[int]:
    """Indices of the children before which the model may be cut."""
    if not isinstance(model, nn.Sequential):
        raise StageCutError(
            f" needs a model that is an nn.Sequential (its stages run in order); "
            f"build_model() returned {type(model).__name__}"
        )
    names = [name for name, _ in model.named_children()]
    if not split_points:
        return list(range(1, len(names)))
    unknown = [p for p in split_points if p not in names]
    if unknown:
        raise ConfigError(
            f"split_points() names {unknown[0]!r}, which is not a child of the model ({', '.join(names)})"
        )
    return sorted(names.index(p) for p in split_points if names.index(p) > 0)


def balanced_bounds(sizes: list[int], candidates: list[int], stages: int) -> tuple[tuple[int, int], ...]:
    """S contiguous stages cut only at `candidates`, minimising the largest stage's parameter count
    (exact, by dynamic programming over the candidate cuts; ties go to the earliest cuts)."""
    if stages - 1 > len(candidates):
        raise StageCutError(
            f" {stages} needs {stages - 1} cuts but the model has {len(candidates)} places to cut "
            f"(at most {len(candidates) + 1} stages)"
        )
    points = [0, *candidates, len(sizes)]
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def cost(i: int, j: int) -> int:  # parameters between points[i] and points[j]
        return prefix[points[j]] - prefix[points[i]]

    n = len(points) - 1
    inf = float("inf")
    # best[k][j]: the least largest-stage count splitting points[0]..points[j] into k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    cuts, j = [], n
    for k in range(stages, 0, -1):
        i = back[k][j]
        cuts.append((points[i], points[j]))
        j = i
    return tuple(reversed(cuts))


def plan_stages(model: nn.Module, split_points: list[str], stages: int) -> StagePlan:
    candidates = cut_candidates(model, split_points)
    children = [(name, child) for name, child in model.named_children()]
    sizes = [sum(p.numel() for p in child.parameters() if p.requires_grad) for _, child in children]
    owners: dict[int, str] = {}
    for name, child in children:
        for p in child.parameters():
            if id(p) in owners:  # a tied weight used by two stages would get two different updates
                raise StageCutError(
                    f": a parameter is shared by children {owners[id(p)]!r} and {name!r} "
                    "(tied weights); untie them to run the model as a pipeline"
                )
            owners[id(p)] = name
    return StagePlan(tuple(n for n, _ in children), tuple(sizes), balanced_bounds(sizes, candidates, stages))


def stage_module(model: nn.Sequential, plan: StagePlan, stage: int) -> nn.Sequential:
    """Stage `stage` of `model`: its children, under their original names (the state dict keys match)."""
    lo, hi = plan.bounds[stage]
    named = dict(model.named_children())
    return nn.Sequential(OrderedDict((name, named[name]) for name in plan.children[lo:hi]))
