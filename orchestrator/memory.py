"""How much memory a run's actors will hold, and a refusal (one line, with the figures) when it cannot fit.

Without this, `--workers 64` on a small machine starts 64 processes that each import torch, and
minutes later Ray's memory monitor kills them with an OutOfMemoryError traceback. The estimate is
made before anything starts, from the model's size and shape and the data set's size:

    per worker = process baseline + parameters x copies + activations + the data set
    per shard  = process baseline + its slice of the parameters x copies
    total      = shared libraries (once) + workers x per worker + shards x per shard

Process baseline: a worker actor's unique memory (USS) with torch, numpy, scikit-learn, Ray's core
worker and distrain loaded and a tiny model trained: 473 MiB measured (psutil memory_full_info of
the TrainWorker processes, peak over a 60-step mlp/digits and cnn/digits run, Ray 2.60, torch CPU,
Linux). Their RSS was 1046 MiB: the other ~575 MiB are shared library pages (torch's .so files),
paid once per machine, not per worker.

Parameter copies: the parameters, their gradients and one communication buffer (3), plus the
optimizer's state: SGD with momentum 1, Adagrad 1, Adam 2. Activations: what autograd keeps
for the backward pass, about the sum of every layer's output for each sample of a batch, counted
from one forward pass on the meta device (shapes only, no memory); twice that, as the backward pass
holds a gradient of the same size while it runs.

Pipelines (--pipeline-stages S): an actor holds one stage, so the estimate is that of the stage
holding the most: its share of the parameter copies (the cuts `trainers/pipeline_split.py` makes),
and the activations of its own layers for the micro-batches it has in flight: GPipe keeps all M
(the whole batch B), 1F1B at most min(M, S - s) on stage s (B x min(M, S)/M on stage 0).

Under --precision bf16/fp16 the master parameters, their gradients and the optimizer state stay float32;
activations are counted at 2 bytes a value (the forward runs in half precision), and so is the half-
precision copy of the weights the forward computes with (autocast's casts, kept for the backward; under
--fsdp D, FSDP's MixedPrecisionPolicy gathers each unit in that dtype instead of float32).

A worker's stated budget (--worker-memory, say a GPU's memory) is checked against its training
state alone (parameter copies and activations; the process and the data set are the host's), so a
model too big for one worker is refused at S = 1 with the number of stages that fits it.

The planner builds on `estimate`; the run's preflight calls `check` and `check_worker`. No Ray import
here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.config.layout_section import can_shard, shards_hint, shards_per_replica, tp_degree, with_shards
from distrain.errors import ResourceError

# in_flight_fraction: the pipeline's own rule, still read here by callers of earlier versions
from distrain.strategies.pipeline import PipelineShape, in_flight_fraction, stages_hint, with_stages  # noqa: F401
from distrain.units import parse_bytes

if TYPE_CHECKING:
    from distrain.config import RunConfig

MiB = 2**20
GiB = 2**30
PROCESS_BYTES = 473 * MiB  # unique memory of one actor process (measured: see the module docstring)
SHARED_BYTES = 575 * MiB  # shared library pages, once per machine
FLOAT_BYTES = 4
BASE_COPIES = 3  # parameters, gradients, a communication buffer
OPTIMIZER_COPIES = {"sgd": 1, "adagrad": 1, "adam": 2}  # sgd: momentum buffer (none at momentum 0)
ACTIVATION_FACTOR = 2  # forward outputs kept for backward, plus their gradients while backward runs
HALF_BYTES = 2  # a bf16/fp16 value


def value_bytes(config: RunConfig) -> int:
    """Bytes of a value the forward computes (an activation, a weight cast for it): 2 under --precision
    bf16/fp16, 4 in float32."""
    return HALF_BYTES if config.precision != "fp32" else FLOAT_BYTES
# Tests (and a user who knows better) set this to the bytes available, e.g. "20GiB", instead of the
# machine's MemAvailable or the cluster's memory resource.
AVAILABLE_ENV = "DISTRAIN_AVAILABLE_MEMORY"


@dataclass(frozen=True)
class MemoryEstimate:
    workers: int
    process: int  # bytes per worker, each part
    model: int
    activations: int
    data: int
    shards: int = 0
    per_shard: int = 0
    shared: int = SHARED_BYTES
    stages: int = 1  # a pipeline's S: model and activations are the largest stage's

    @property
    def training_state(self) -> int:
        """What training itself holds in one worker: parameter copies and activations."""
        return self.model + self.activations

    @property
    def per_worker(self) -> int:
        return self.process + self.model + self.activations + self.data

    @property
    def total(self) -> int:
        return self.shared + self.workers * self.per_worker + self.shards * self.per_shard

    def describe(self) -> str:
        """'64 workers need ~30.2 GiB (0.47 GiB each: 0.46 process, 0.00 model ..., ...)'."""
        parts = ", ".join(
            f"{value / GiB:.2f} {name}"
            for name, value in (
                ("process", self.process),
                ("model and optimizer", self.model),
                ("activations", self.activations),
                ("data", self.data),
            )
        )
        if self.stages > 1:
            parts += f"; the largest of {self.stages} stages"
        text = f"{self.workers} workers need ~{self.total / GiB:.1f} GiB ({self.per_worker / GiB:.2f} GiB each: {parts}"
        if self.shards:
            text += f"; plus {self.shards} parameter-server shards x {self.per_shard / GiB:.2f} GiB"
        return text + f"; {self.shared / GiB:.2f} GiB of shared libraries once)"


def optimizer_copies(optimizer: str, momentum: float | None) -> int:
    if optimizer == "sgd":  # momentum None is sgd's default 0.9: one buffer
        return 0 if momentum == 0 else 1
    return OPTIMIZER_COPIES.get(optimizer, 2)


def activation_values(model: str, dataset: str) -> int:
    """Floats of layer outputs one sample produces in a forward pass: every leaf module's output,
    summed, from a pass on the meta device (shapes only; nothing is allocated or initialised)."""
    info = _dataset_info(dataset)
    return sum(child_activation_values(model, dataset).values()) + info.channels * info.height * info.width


def _dataset_info(dataset: str) -> Any:  # imported late: the data sets' registry loads torch
    from distrain.trainers.datasets import DATASETS

    return DATASETS.get(dataset).info


def child_activation_values(model: str, dataset: str) -> dict[str, int]:
    """`activation_values` by the model's top-level child (a pipeline's stages are runs of them),
    the input excluded."""
    import torch

    from distrain.trainers.models import MODELS

    info = _dataset_info(dataset)
    with torch.device("meta"):
        net = MODELS.get(model)(info)
        totals: dict[str, int] = {name: 0 for name, _ in net.named_children()}

        def counter(child: str):  # noqa: ANN202
            def count(module: torch.nn.Module, inputs: object, output: object) -> None:
                if isinstance(output, torch.Tensor):
                    totals[child] += output.numel()

            return count

        hooks = []
        for name, child in net.named_children():
            leaves = [m for m in child.modules() if not list(m.children())]
            hooks += [m.register_forward_hook(counter(name)) for m in leaves]
        if not totals:  # a model that is one leaf
            totals[""] = 0
            hooks.append(net.register_forward_hook(counter("")))
        try:
            net.eval()  # the same shapes; BatchNorm in training mode refuses a batch of one
            net(torch.empty(1, info.channels, info.height, info.width))
        finally:
            for h in hooks:
                h.remove()
    return totals


def stage_shares(config: RunConfig) -> list[tuple[int, int]]:
    """Per pipeline stage: (trainable parameter values, activation values one sample produces in it,
    its input included). A user's task: activations unknown (0), as without a pipeline."""
    from distrain.strategies.pipeline import plan_stages_for

    task, model = _meta_model(config)
    if task is not None:
        plan = plan_stages_for(model, task.split_points(), config)
        return [(plan.stage_params(s), 0) for s in range(plan.stages)]
    info = _dataset_info(config.dataset)
    plan = plan_stages_for(model, [], config)
    per_child = child_activation_values(config.model, config.dataset)
    values = [per_child.get(name, 0) for name in plan.children]
    shares = []
    for s, (lo, hi) in enumerate(plan.bounds):
        # The stage's input: the data for stage 0, the previous stage's last output otherwise (an upper
        # bound: that child's leaves' outputs, summed).
        given = info.channels * info.height * info.width if s == 0 else values[lo - 1]
        shares.append((plan.stage_params(s), sum(values[lo:hi]) + given))
    return shares


def _meta_model(config: RunConfig) -> tuple[Any, Any]:
    """(the user's task or None for the built-in one, the run's model built on the meta device: shapes
    only, nothing allocated), as its workers build them."""
    import torch

    if config.task:
        from distrain.orchestrator.tasks import build_task

        task = build_task(config)
        try:
            with torch.device("meta"):
                return task, task.build_model()
        except Exception:  # noqa: BLE001 - a model that needs real tensors to build (loads weights, say)
            return task, task.build_model()
    from distrain.trainers.models import MODELS

    with torch.device("meta"):
        return None, MODELS.get(config.model)(_dataset_info(config.dataset))


def tp_plan(config: RunConfig, task: Any) -> dict[str, Any]:
    """The run's tensor-parallel plan at its --tensor-parallel T: the user's task's, or the built-in
    model's ({} where there is none, or at T = 1)."""
    from distrain.trainers.tensor_parallel import BUILTIN_PLANS

    tp = tp_degree(config)
    if tp == 1:
        return {}
    return (task.tensor_parallel_plan(tp) if task is not None else BUILTIN_PLANS.get(config.model)) or {}


@dataclass(frozen=True)
class CutSizes:
    """The parameter values a cut replica's worker memory depends on (--tensor-parallel, --fsdp), from one
    build of the model: its trainable total, one tensor-parallel worker's part of it under the task's plan
    (the total at T = 1), and the largest module `fully_shard` gathers whole at once."""

    total: int
    held: int
    largest_unit: int

    @classmethod
    def of(cls, config: RunConfig) -> CutSizes:
        from distrain.trainers.sharded_trainer import fsdp_units
        from distrain.trainers.tensor_parallel import local_params

        task, model = _meta_model(config)
        total = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tp = tp_degree(config)
        held = local_params(model, tp_plan(config, task), tp) if tp > 1 else total
        units = [sum(p.numel() for p in unit.parameters()) for unit in fsdp_units(model)]
        own = sum(p.numel() for p in model.parameters(recurse=False))  # the root's own, gathered with it
        return cls(total, held, max([own, *units]))


def estimate(config: RunConfig, num_params: int, cut: CutSizes | None = None) -> MemoryEstimate:
    """What the run's worker actors (and parameter-server shards) will hold, in bytes. A cut replica's
    figures come from `cut` (`CutSizes.of(config)` when not given)."""
    from distrain.orchestrator.trial_resources import num_shards
    from distrain.trainers.datasets import DATASETS

    copies = BASE_COPIES + optimizer_copies(config.optimizer, config.momentum)
    # A user's task: its activations and data are not known before its workers build it, so only the
    # process and the parameter copies are counted (a lower bound).
    builtin = not config.task
    value = value_bytes(config)
    # --precision bf16/fp16: the weights the forward computes with, in half precision (float32: the masters)
    half_copy = 1 if value < FLOAT_BYTES else 0
    pipeline = PipelineShape.of(config)
    if config.pipelined:  # the stage holding the most: its parameter copies (1/D each under --fsdp D) and
        # in-flight activations
        shards = shards_per_replica(config)
        held = [
            (-(-params // shards) * FLOAT_BYTES * copies + params * value * half_copy,
             int(ACTIVATION_FACTOR * config.unit_samples * pipeline.in_flight(s) * values) * value)
            for s, (params, values) in enumerate(stage_shares(config))
        ]  # fmt: skip
        model_bytes, activation_bytes = max(held, key=sum)
    else:
        per_sample = activation_values(config.model, config.dataset) if builtin else 0
        # --tensor-parallel T: the worker's part of the planned layers; --fsdp D: 1/D of every copy of
        # that, plus the largest unit's parameters gathered whole while it runs.
        if config.sharded:
            cut = cut or CutSizes.of(config)
            shards = shards_per_replica(config)
            model_bytes = -(-cut.held // shards) * FLOAT_BYTES * copies
            if shards > 1:  # the unit FSDP gathers, in the dtype it computes in
                model_bytes += cut.largest_unit * value
            else:  # tensor parallelism alone: autocast's half copy of the worker's part
                model_bytes += cut.held * value * half_copy
        else:
            model_bytes = num_params * (FLOAT_BYTES * copies + value * half_copy)
        activation_bytes = ACTIVATION_FACTOR * config.batch_size * per_sample * value
    shards = num_shards(config)
    # A shard holds θ, a gradient sum and the optimizer state for its slice.
    shard_copies = 2 + optimizer_copies(config.optimizer, config.momentum)
    per_shard = PROCESS_BYTES + (-(-num_params // shards) * FLOAT_BYTES * shard_copies if shards else 0)
    return MemoryEstimate(
        workers=config.num_worker_actors,
        process=PROCESS_BYTES,
        model=model_bytes,
        activations=activation_bytes,
        data=DATASETS.get(config.dataset).memory_bytes if builtin else 0,
        shards=shards,
        per_shard=per_shard if shards else 0,
        stages=pipeline.stages,
    )


def local_available() -> int:
    """Memory this machine can give new processes without swapping (MemAvailable), or the override."""
    override = os.environ.get(AVAILABLE_ENV)
    if override:
        return parse_bytes(override)
    try:
        with open("/proc/meminfo") as f:  # Linux: no dependency needed
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # elsewhere (a Ray dependency)

    return int(psutil.virtual_memory().available)


def check(est: MemoryEstimate, available: int, where: str = "this machine") -> None:
    """Refuse, with the figures, a run whose actors cannot fit in `available` bytes."""
    if est.total <= available:
        return
    fewer = "use fewer workers" if est.workers > 1 else "use a smaller --model or --batch-size"
    if est.shards > 1:
        fewer += " (or fewer --ps-shards)"
    raise ResourceError(f"{est.describe()}, but {where} has {available / GiB:.1f} GiB available; {fewer}")


def check_worker(config: RunConfig, est: MemoryEstimate) -> None:
    """Refuse, in one line, a run whose largest worker's training state is over --worker-memory,
    naming the fewest pipeline stages that would fit it (when some do)."""
    if not config.worker_memory:
        return
    budget = parse_bytes(config.worker_memory)
    if est.training_state <= budget:
        return
    what = f"the largest of {est.stages} pipeline stages" if est.stages > 1 else "one worker"
    if config.sharded:
        what = f"each of a replica's {shards_per_replica(config)} shards"
    line = (
        f"{what} would hold ~{est.training_state / MiB:.1f} MiB ({est.model / MiB:.1f} MiB of parameters, "
        f"gradients and optimizer state, {est.activations / MiB:.1f} MiB of activations), over --worker-memory "
        f"{config.worker_memory} ({budget / MiB:.1f} MiB)"
    )
    stages = None if config.sharded else fewest_stages(config, budget)
    shards = fewest_shards(config, budget) if can_shard(config) else None
    ways = ([stages_hint(stages)] if stages else []) + ([shards_hint(shards)] if shards else [])
    if ways:
        line += "; " + " or ".join(ways)
    else:
        line += "; use a smaller --model or --batch-size, or a larger budget"
    raise ResourceError(line)


def fewest_shards(config: RunConfig, budget: int, most: int = 64) -> int | None:
    """The fewest --fsdp shards (more than the run's) whose worker fits `budget`, up to `most`; or None."""
    cut = CutSizes.of(config)  # the model's sizes do not change with D: built once for every candidate
    for shards in range(max(shards_per_replica(config) + 1, 2), most + 1):
        if estimate(with_shards(config, shards), cut.total, cut).training_state <= budget:
            return shards
    return None


def fewest_stages(config: RunConfig, budget: int) -> int | None:
    """The fewest pipeline stages (more than the run's) whose largest stage fits `budget`, or None."""
    from distrain.errors import ConfigError

    stages = max(PipelineShape.of(config).stages + 1, 2)
    while True:
        try:
            trial = with_stages(config, stages)
            if estimate(trial, 0).training_state <= budget:
                return stages
        except ConfigError:  # past the model's cut points
            return None
        stages += 1
