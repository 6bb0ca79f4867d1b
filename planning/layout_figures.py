"""Which cut-replica layouts a plan predicts, and what the model says of each (`layout_model.Layout`).

A plan predicts a layout when the run names one (`--fsdp D`, `--tensor-parallel T`), or, when one worker
cannot hold the model under `--worker-memory` (the run's own refusal, `memory.check_worker`), the layouts
that fit: the smallest D (`memory.fewest_shards`), and with T = 2 when the task has a tensor-parallel plan
that splits its model two ways, the smallest D x 2. Without a budget nothing is proposed: a model's fit is
the budget's question (the machine's total memory does not shrink by sharding).

The figures come from one build of the model on the meta device (shapes only): its FSDP units, and, for the
built-in models, one forward and backward of a sample with torch's FlopCounterMode and hooks on the planned
layers: each rowwise layer's output and each colwise layer's input gradient (where its input needs one)
are what tensor parallelism all-reduces, and the planned layers' FLOPs over the model's are the share of
compute T workers split. A user's task cannot be run without its data: its split share is then the
planned layers' share of the parameters, and its activation all-reduces are not counted (said so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrain.config.layout_section import can_shard, tp_degree, with_shards
from distrain.errors import ConfigError
from distrain.orchestrator import memory
from distrain.planning.layout_model import Layout

if TYPE_CHECKING:
    from distrain.config import RunConfig

PROPOSED_TP = 2  # the tensor-parallel degree tried beside FSDP alone when the model does not fit


def model_figures(config: RunConfig) -> dict[str, Any]:
    """units, tp_activation_values, tp_all_reduces, split_share of the run's model under its tensor-
    parallel plan at its T (none at T = 1)."""

    from distrain.trainers.sharded_trainer import fsdp_units

    task, model = memory._meta_model(config)
    units = len(fsdp_units(model)) + (1 if any(True for _ in model.parameters(recurse=False)) else 0)
    figures: dict[str, Any] = {"units": max(1, units), "tp_activation_values": 0, "tp_all_reduces": 0,
                               "split_share": 0.0}  # fmt: skip
    tp = tp_degree(config)
    if tp == 1:
        return figures
    plan = memory.tp_plan(config, task)
    modules = dict(model.named_modules())
    planned = {name: style for name, style in plan.items() if name in modules}
    if task is not None:  # no sample to run: the planned layers' share of the parameters
        total = sum(p.numel() for p in model.parameters() if p.requires_grad)
        split = sum(p.numel() for name in planned for p in modules[name].parameters())
        return figures | {"split_share": split / total if total else 0.0}
    return figures | _traced(model, planned, config.dataset)


def _traced(model: Any, planned: dict[str, Any], dataset: str) -> dict[str, Any]:
    """One sample's forward and backward on the meta device, counting the planned layers' all-reduced
    activations and their FLOPs."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from distrain.trainers.datasets import DATASETS

    info = DATASETS.get(dataset).info
    values = [0, 0]  # activation values all-reduced per sample, all-reduces

    def hook(style: Any):  # noqa: ANN202
        def count(module: Any, inputs: tuple, output: Any) -> None:
            if style == "rowwise":  # its output's partial sums, in the forward
                values[0] += output.numel()
                values[1] += 1
            elif style == "colwise" and inputs[0].requires_grad:  # its input's gradient, in the backward
                values[0] += inputs[0].numel()
                values[1] += 1

        return count

    modules = dict(model.named_modules())
    hooks = [modules[name].register_forward_hook(hook(style)) for name, style in planned.items()]
    try:
        model.eval()  # the same shapes; BatchNorm in training mode refuses a batch of one
        with FlopCounterMode(display=False) as counter:
            model(torch.empty(1, info.channels, info.height, info.width, device="meta")).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    root = type(model).__name__
    split = sum(counts.get(f"{root}.{name}", 0) for name in planned)
    total = counter.get_total_flops()
    return {"tp_activation_values": values[0], "tp_all_reduces": values[1],
            "split_share": split / total if total else 0.0}  # fmt: skip


def layout_of(config: RunConfig) -> Layout:
    """The run's layout (its --fsdp, --tensor-parallel, --reshard-after-forward) with the model's figures,
    the memory estimate's per-worker bytes at it, and under --compress the codec's transfers of a worker's
    part across the replicas (`codec_parts`)."""
    cut = memory.CutSizes.of(config)
    est = memory.estimate(config.replace(workers=1), cut.total, cut)
    d, t = config.replica_grid[:2]
    return Layout(
        fsdp=d, tensor_parallel=t, reshard_after_forward=config.reshard_after_forward, held_params=cut.held,
        memory_per_worker=est.per_worker, training_state=est.training_state, codec_parts=codec_parts(config),
        value_bytes=memory.value_bytes(config),
        **model_figures(config),
    )  # fmt: skip


def part_shapes(config: RunConfig) -> list[tuple[int, ...]]:
    """The shapes of a cut replica's worker 0's parts of the model's tensors: its tensor-parallel part
    under the task's plan, then FSDP's first dim-0 chunk of that (ceil(rows / D) rows: the largest, as
    torch.chunk cuts), as strategies/sharded_bsp.py `local_shapes` reads them off the real shards."""
    from distrain.trainers.tensor_parallel import local_part_shapes

    task, model = memory._meta_model(config)
    d, t = config.replica_grid[:2]
    return [(-(-s[0] // d), *s[1:]) if s else s for s in local_part_shapes(model, memory.tp_plan(config, task), t)]


def codec_parts(config: RunConfig) -> tuple[tuple[str, int], ...]:
    """Under --compress, the transfers [(collective, payload bytes)] of one compressed average of a
    worker's part across the replicas, read from the codec's own encoding of tensors of its part's shapes
    (compressed_collective.wire_parts, as for plain workers); () without a codec."""
    from distrain.compression.spec import codec_of

    spec = codec_of(config)
    if spec is None:
        return ()
    from distrain.strategies.compressed_collective import wire_parts

    return tuple(wire_parts(spec, part_shapes(config)))


def planned_layouts(config: RunConfig) -> tuple[list[Layout], str]:
    """(the layouts a plan predicts besides the plain workers, why: the first words of its reason); none
    when the run names no layout and one worker fits."""
    if config.sharded:
        if tp_degree(config) > 1:  # the run's own check (a plan read back with --calibration runs no other)
            from distrain.orchestrator.run_checks import check_tensor_parallel

            check_tensor_parallel(config)
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (("fsdp", config.replica_grid[0]),
                         ("tensor_parallel", config.replica_grid[1])) if v > 1)  # fmt: skip
        return [layout_of(config)], f"the run's {flags}"
    if not config.worker_memory:
        return [], ""
    from distrain.units import parse_bytes

    budget = parse_bytes(config.worker_memory)
    plain = memory.estimate(config.replace(workers=1), memory.CutSizes.of(config).total)
    if plain.training_state <= budget or not can_shard(config):
        return [], ""
    why = (
        f"one worker would hold ~{plain.training_state / memory.MiB:.1f} MiB, over --worker-memory "
        f"{config.worker_memory}"
    )
    fitting = []
    shards = memory.fewest_shards(config, budget)
    if shards:
        fitting.append(with_shards(config, shards))
    split = config.replace(tensor_parallel=PROPOSED_TP)
    if _has_plan(split):
        cut = memory.CutSizes.of(split)
        if memory.estimate(split.replace(workers=1), cut.total, cut).training_state <= budget:
            fitting.append(split)
        elif shards := memory.fewest_shards(split, budget):
            fitting.append(with_shards(split, shards))
    return [layout_of(c) for c in fitting], why


def _has_plan(config: RunConfig) -> bool:
    """Whether the task's tensor-parallel plan splits its model T ways (the run's own check)."""
    from distrain.orchestrator.run_checks import check_tensor_parallel

    try:
        check_tensor_parallel(config)
    except ConfigError:
        return False
    return True
