"""Pipelines: BSP over R replicas of a model cut into S stages (`--pipeline-stages S --microbatches M`).

S x R worker actors; actor rank = replica x S + stage (so --chaos kill-worker@STEP:RANK and the display
name actors that way: ranks 0..S-1 are replica 0's stages). Each actor holds one stage of the model
(`trainers/pipeline_split.py`), its gradient and its optimizer state. Per step:

1. the replica's batch (slice `replica` of the global batch) is cut into M micro-batches and run through
   the stages by torch.distributed.pipelining's `ScheduleGPipe` or `Schedule1F1B` over the replica's
   own process group (point-to-point over gloo); the task's `criterion` runs on the last stage, and the
   schedule divides the accumulated gradient by M (`scale_grads`), so with a mean-reduced criterion
   and equal micro-batches the stage holds the gradient of the mean loss over the replica's batch;
2. each stage's gradient is averaged with its R copies (one all-reduce over the stage's data-parallel
   group), then every stage steps its own optimizer: the update BSP makes on the global batch R x B.

Unequal replica shares (--worker-weights, one weight per replica; docs/heterogeneous.md): replica r takes
b_r samples of the step's B (its contiguous block, whole sets of its micro-batches, so they stay equal:
config/shares_section.py `replica_shares`); its stages' gradients are the mean over its b_r samples, and
each stage multiplies its gradient by b_r x R / B before the all-reduce (`weigh_share`), so the mean over
the R copies is the whole batch's mean gradient, the update of one process at B.

The process groups: one default group of all S x R actors (the run's TCP rendezvous, as BSP's), plus
per-replica pipeline groups and per-stage data-parallel groups made from it with `new_group` (every
actor creates every group, in the same order, as torch requires).

What is written by hand instead of taken from torch: evaluation (a plain forward, stage to stage, with
`send`/`recv` and a shape header: the schedules' `eval` fixes the micro-batch count and caches shapes,
but the test set's last batch is smaller), and the per-stage measurements (compute, waits, memory),
which wrap the stage's `forward_one_chunk`/`backward_one_chunk` and the schedules' `_wait_batch_p2p`.

Other strategies do not compose here: local SGD across replicas would be sound (each stage averages
its θ change with its copies every τ steps) but is not built; PS strategies would need a shard per
stage slice and a pipeline-wide clock; DiLoCo, --compress and backup workers are refused likewise
(config.py `_validate_pipeline`).

This module imports no torch at import time: config.py reads `PIPELINE_SCHEDULES` from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError
from distrain.strategies.activation_meter import ActivationMeter
from distrain.strategies.base import CommStats, Strategy, StrategyContext, all_finite

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    import torch

    from distrain.config import RunConfig
    from distrain.trainers.local_trainer import LocalTrainer
    from distrain.trainers.pipeline_split import StagePlan

PIPELINE_SCHEDULES = ("gpipe", "1f1b")

# Per-stage columns of every step row (strategies/base.py `metric_columns`).
PIPELINE_COLUMNS = {
    "stage": "int32",
    "replica": "int32",
    # The replica's samples this step, on every stage's row (`samples` counts them on the last stage only):
    # what --balance speed's pipeline balancer reads each stage's time against.
    "replica_samples": "int32",
    "pipe_step_s": "float64",  # the schedule's step, wall time
    "pipe_compute_s": "float64",  # forward and backward of this stage's micro-batches
    # The CPU time of those forwards and backwards (this thread's): below pipe_compute_s by the time the
    # stage was runnable but off the CPU mid-computation (more stage processes than cores).
    "pipe_compute_cpu_s": "float64",
    # Seconds over the step this stage's thread was ready to run but waited for a core (Linux's run
    # delay, /proc/thread-self/schedstat; null elsewhere): in its compute (pipe_compute_s less
    # pipe_compute_cpu_s) and after each wake-up, e.g. when a micro-batch it waited for arrived.
    "pipe_runq_s": "float64",
    "pipe_wait_s": "float64",  # blocked in point-to-point waits (sends and receives)
    "pipe_idle_frac": "float64",  # 1 - compute / step: the bubble plus transfer time
    "mem_param_bytes": "int64",
    "mem_grad_bytes": "int64",
    "mem_optim_bytes": "int64",
    "mem_activation_peak_bytes": "int64",  # saved for backward, at most at once (saved_tensors_hooks)
    "mem_gpu_peak_bytes": "int64",  # on a GPU: torch.cuda.max_memory_allocated over the step (else null)
    # JSON [[kind, micro-batch, start, end], ...] in wall-clock seconds, for this actor's steps 2-4 of an
    # attempt (the first holds torch's shape inference): the report's pipeline timeline.
    "pipe_spans": "string",
}
TIMELINE_STEPS = range(1, 4)  # which of an actor's steps (counted from 0) keep their spans


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B with equal stages: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def in_flight_fraction(schedule: str, stages: int, microbatches: int, stage: int) -> float:
    """The share of a replica's batch whose activations stage `stage` holds at once: GPipe runs every
    forward before any backward (all M micro-batches); 1F1B at most S - stage of them."""
    if schedule == "1f1b":
        return min(microbatches, stages - stage) / microbatches
    return 1.0


@dataclass(frozen=True)
class PipelineShape:
    """A run's pipeline as the rest of distrain asks for it (the memory estimate, the placement, the
    worker's stage, the checks): --pipeline-stages, --microbatches and --pipeline-schedule are read from
    the config here, so no other module names them."""

    stages: int  # S: actors per replica, one stage each
    micro: int  # M: micro-batches each replica's batch is cut into
    schedule: str  # one of PIPELINE_SCHEDULES

    @classmethod
    def of(cls, config: RunConfig) -> PipelineShape:
        """(--accumulate-steps k runs one schedule of k x M micro-batches: `PipelineBSP.setup`.)"""
        section = config.section("strategy")
        return cls(section.pipeline_stages, section.microbatches * config.accumulate_steps, section.pipeline_schedule)

    def in_flight(self, stage: int) -> float:
        """The share of a replica's batch whose activations stage `stage` holds at once."""
        return in_flight_fraction(self.schedule, self.stages, self.micro, stage)


def check_pipeline_task(task: Any, config: RunConfig) -> None:
    """--pipeline-stages S: the task's model is an nn.Sequential with at least S - 1 places to cut, without
    tied weights, and the task has a `criterion` for the last stage to run (ConfigError otherwise)."""
    from distrain.trainers.task import Task

    if type(task).criterion is Task.criterion:
        raise ConfigError(
            f"--pipeline-stages needs the task to define forward() and criterion() (the last stage runs the "
            f"criterion); {type(task).__name__} defines only loss()"
        )
    plan_stages_for(task.build_model(), task.split_points(), config)


def plan_stages_for(model: Any, split_points: list[str], config: RunConfig) -> StagePlan:
    """`model` cut into the run's S stages (trainers/pipeline_split.py); a model that cannot be cut so is
    refused in the flag's own words ("--pipeline-stages 9 needs 8 cuts but ...")."""
    from distrain.trainers.pipeline_split import StageCutError, plan_stages

    try:
        return plan_stages(model, split_points, PipelineShape.of(config).stages)
    except StageCutError as e:
        raise ConfigError("--pipeline-stages" + e.detail) from None


def stages_hint(stages: int) -> str:
    """The memory refusal's suggestion (orchestrator/memory.py), in the flag's own words."""
    return f"--pipeline-stages {stages} splits it so each stage fits"


def with_stages(config: RunConfig, stages: int) -> RunConfig:
    """`config` cut into `stages` stages (what the memory refusal suggests): its micro-batches kept where it
    already was a pipeline, one otherwise."""
    shape = PipelineShape.of(config)
    return config.replace(pipeline_stages=stages, microbatches=shape.micro if shape.stages > 1 else 1)


class _Timer:
    """Compute and wait seconds of one stage within a step, and the (kind, micro-batch, start, end)
    spans of its computations (the report's timeline)."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.cpu = 0.0  # the compute's CPU time (time.thread_time)
        self.wait = 0.0
        self.spans: list[tuple[str, int, float, float]] = []
        self.origin = 0.0
        self.run_delay: float | None = None  # this thread's run delay when the step began

    def reset(self) -> None:
        self.compute, self.cpu, self.wait, self.spans = 0.0, 0.0, 0.0, []
        self.origin = time.perf_counter()
        self.run_delay = run_delay_s()


def run_delay_s() -> float | None:
    """Seconds this thread has waited for a core since it started (Linux); None where not known."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


_ACTIVE_TIMER: _Timer | None = None  # one stage per actor process: the schedules' waits are its


def _install_wait_timer() -> None:
    """Time the schedules' point-to-point waits (a module-level function they call by global name)."""
    from torch.distributed.pipelining import schedules

    if getattr(schedules._wait_batch_p2p, "_distrain_timed", False):
        return
    original = schedules._wait_batch_p2p

    def timed(work: Any) -> None:
        t0 = time.perf_counter()
        try:
            original(work)
        finally:
            if _ACTIVE_TIMER is not None:
                _ACTIVE_TIMER.wait += time.perf_counter() - t0

    timed._distrain_timed = True  # type: ignore[attr-defined]
    schedules._wait_batch_p2p = timed


_PREPOSTED: dict[type, type] = {}


def _preposted_gpipe(base: type) -> type:
    """torch's `ScheduleGPipe` with every receive of a step posted when the step starts.

    torch's GPipe posts micro-batch i's receive only when it is about to run i. Over gloo a send is a
    rendezvous: the data leaves only once the peer has posted its receive, so a receive posted late costs
    one more message each way, each handled by a gloo thread that must first get a core, and a stage
    whose sender is already done waits that long for every micro-batch (RESULTS.md, issue 32). Posted
    at the start (every micro-batch has its own buffers), each activation and gradient moves as soon as
    it is sent; the order of computation, sends and waits is torch's, so the result is the same.
    """
    if base in _PREPOSTED:
        return _PREPOSTED[base]
    from torch.distributed.pipelining import schedules

    class PrepostedGPipe(base):  # type: ignore[valid-type, misc]
        def _step_microbatches(
            self,
            arg_mbs: list[Any] | None = None,
            kwarg_mbs: list[Any] | None = None,
            target_mbs: list[Any] | None = None,
            losses: list[Any] | None = None,
            return_outputs: bool = True,
            loss_kwargs: dict[str, Any] | None = None,
        ) -> None:
            arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
            first_target = target_mbs[0] if target_mbs is not None else None
            self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
            stage, m = self._stage, self._n_microbatches
            # Every receive of the step, posted now (the waits go through the module's timed function).
            fwd_recvs = [schedules._sorted_batch_p2p(stage.get_fwd_recv_ops(i), desc="fwd_recv") for i in range(m)]
            bwd_recvs = [schedules._sorted_batch_p2p(stage.get_bwd_recv_ops(i), desc="bwd_recv") for i in range(m)]
            sends: list[Any] = []
            for i in range(m):
                for work in fwd_recvs[i].values():
                    schedules._wait_batch_p2p(work)
                output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
                sends.extend(schedules._sorted_batch_p2p(stage.get_fwd_send_ops(i), desc="fwd_send").values())
                self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
            for work in sends:
                schedules._wait_batch_p2p(work)
            sends = []
            for i in range(m):
                for work in bwd_recvs[i].values():
                    schedules._wait_batch_p2p(work)
                loss = self._maybe_get_loss(stage, i)
                stage.backward_one_chunk(i, loss=loss, last_backward=i == m - 1)
                sends.extend(schedules._sorted_batch_p2p(stage.get_bwd_send_ops(i), desc="bwd_send").values())
            for work in sends:
                schedules._wait_batch_p2p(work)
            self._update_losses(stage, losses)
            stage.perform_reduce_grad(m if self.scale_grads else 1)

    _PREPOSTED[base] = PrepostedGPipe
    return PrepostedGPipe


class _Captured(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args_, self.kwargs_ = args, kwargs


def model_inputs(task: Any, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What the task's `forward` passes to the model for `batch` (stage 0's input), found by calling it
    with a stand-in model that records its arguments."""
    from torch import nn

    class Capture(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise _Captured(args, kwargs)

    try:
        task.forward(Capture(), batch)
    except _Captured as c:
        return c.args_, c.kwargs_
    raise TypeError(f"{type(task).__name__}.forward did not call the model")


class _Fixed:
    """A stand-in model that returns the last stage's output whatever it is given (evaluation)."""

    def __init__(self, output: Any) -> None:
        self.output = output
        self.training = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.output

    def eval(self) -> _Fixed:
        return self

    def train(self, mode: bool = True) -> _Fixed:
        return self


def _nbytes(values: Any) -> int:
    """Bytes of the tensors in `values` (nested in tuples and lists)."""
    import torch

    if torch.is_tensor(values):
        return values.numel() * values.element_size()
    if isinstance(values, tuple | list):
        return sum(_nbytes(v) for v in values)
    return 0


def batch_length(batch: Any) -> int:
    """The samples in `batch` (tensors, possibly nested): its first tensor's length along dim 0."""
    import torch

    if torch.is_tensor(batch):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, tuple | list) else ()
    for v in values:
        n = batch_length(v)
        if n:
            return n
    return 0


def split_batch(batch: Any, parts: int) -> list[Any]:
    """`batch` (tensors, possibly nested in tuples, lists and dicts) cut into `parts` along dim 0."""
    import torch

    if torch.is_tensor(batch):
        return list(torch.tensor_split(batch, parts))
    if isinstance(batch, dict):
        pieces = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: pieces[k][i] for k in batch} for i in range(parts)]
    if isinstance(batch, tuple | list):
        pieces_list = [split_batch(v, parts) for v in batch]
        return [type(batch)(p[i] for p in pieces_list) for i in range(parts)]
    return [batch] * parts


class PipelineBSP(Strategy):
    """`bsp` with --pipeline-stages S >= 2 (BSP.implementation picks it)."""

    name = "bsp"
    metric_columns = PIPELINE_COLUMNS

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.stages = config.pipeline_stages
        self.replicas = ctx.world_size // self.stages
        self.stage, self.replica = ctx.rank % self.stages, ctx.rank // self.stages
        self.first = self.stage == 0
        self.last = self.stage == self.stages - 1
        self.timer = _Timer()
        self.full_state: dict[str, Any] | None = None
        self.bytes_p2p = (0, 0)  # this step's activations/gradients (sent, received)
        self.stats: dict[str, Any] = {}
        self.steps_run = 0
        self.share_weight = 1.0  # b_r x R / B under unequal replica shares (`weigh_share`)

    @classmethod
    def summary_figures(cls, steps: dict[str, list[Any]]) -> dict[str, Any]:
        """Per stage: median idle fraction, compute and wait per step (steps after the first, which holds
        torch's shape inference), and the most bytes held (parameters, gradients, optimizer state, saved
        activations)."""
        import pandas as pd

        df = pd.DataFrame({k: steps[k] for k in ("step", "stage", *PIPELINE_COLUMNS) if k in steps})
        if df.empty or "stage" not in df or df["stage"].isna().all():
            return {}
        later = df[df["step"] > df["step"].min()] if df["step"].nunique() > 1 else df
        stages: dict[str, Any] = {}
        for stage, rows in later.groupby("stage"):
            held = df[df["stage"] == stage]
            stages[str(int(stage))] = {
                "idle_frac": float(rows["pipe_idle_frac"].median()),
                "compute_s": float(rows["pipe_compute_s"].median()),
                "wait_s": float(rows["pipe_wait_s"].median()),
                "param_bytes": int(held["mem_param_bytes"].max()),
                "grad_bytes": int(held["mem_grad_bytes"].max()),
                "optim_bytes": int(held["mem_optim_bytes"].max()),
                "activation_peak_bytes": int(rows["mem_activation_peak_bytes"].max()),
            }
            if "mem_gpu_peak_bytes" in rows and rows["mem_gpu_peak_bytes"].notna().any():
                stages[str(int(stage))]["gpu_peak_bytes"] = int(rows["mem_gpu_peak_bytes"].max())
        return {"pipeline_stages_figures": stages}

    @classmethod
    def check_codec(cls, config: RunConfig, codec: Any) -> None:
        from distrain.compression.spec import FLAG
        from distrain.errors import ConfigError

        raise ConfigError(f"{FLAG} does not compose with --pipeline-stages; drop one of them ({FLAG} {codec})")

    @property
    def counts_samples(self) -> bool:
        """Only the last stage counts a replica's samples (all S stages write a row per step)."""
        return self.last

    @property
    def slices_per_step(self) -> int:
        return self.replicas

    def plan(self, units: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        # The work plan gives actor r slice r; a pipeline's S stages all read their replica's slice.
        for epoch, step, _ in units:
            yield epoch, step, self.replica

    def weigh_share(self, samples: int, step_samples: int) -> None:
        """Unequal replica shares: every stage of replica r gets the replica's b_r (its slice of the step),
        and weights its gradient by b_r x R / B before the stage's all-reduce over the R copies (`step`;
        the channel's own weight applies to the whole group's gradient all-reduce, which a pipeline has not)."""
        from distrain.trainers.shares import gradient_weight

        self.share_weight = gradient_weight(samples, self.replicas, step_samples)

    def pipeline_ranks(self) -> list[int]:
        return [self.replica * self.stages + s for s in range(self.stages)]

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: LocalTrainer) -> None:
        self.channel.join()
        S, R = self.stages, self.replicas
        # Every rank makes every group, in one order (torch.distributed requires it).
        self.pipe_group = None
        for r in range(R):
            group = self.channel.subgroup([r * S + s for s in range(S)])  # the stages' p2p (torch's schedule)
            if r == self.replica:
                self.pipe_group = group
        self.dp_group = None
        if R > 1:
            for s in range(S):
                group = self.channel.subgroup([r * S + s for r in range(R)])
                if s == self.stage:
                    self.dp_group = group
            # Replicas start equal because the seed fixes the init; the broadcast makes it a fact.
            self.channel.broadcast(trainer.params_flat, src=self.stage, subgroup=self.dp_group)
        self.make_schedule(trainer)
        self.meter = ActivationMeter(trainer.params_flat.untyped_storage().data_ptr())

    def make_schedule(self, trainer: LocalTrainer) -> None:
        """torch's stage of `trainer.model` over this worker's pipeline group and the run's schedule of its
        micro-batches (the task's criterion as the last stage's loss), timed."""
        self.trainer = trainer
        if not self.last:  # gloo sends and receives only contiguous tensors (a pooling layer's output may not be)
            trainer.model.register_forward_hook(lambda module, args, out: out.contiguous())
        # --accumulate-steps k: one schedule over k x M micro-batches of B/M (the mean over all of them is
        # the gradient of the k x B batch's mean loss); the clip is the replica's, in `step`, not the stage's.
        self.parts = self.config.microbatches * self.config.accumulate_steps
        trainer.clip_grad_norm = 0.0
        self._mbs: list[Any] = []
        _install_wait_timer()
        self._count_input_bytes()
        self._build_schedule()
        self.built_for: int | None = None  # the replica's samples per step the schedule last ran at

    def _build_schedule(self) -> None:
        """A fresh torch stage and schedule. torch sizes a stage's receive buffers from its first step's
        micro-batches and keeps them, so when --balance speed moves this replica's share (its micro-batches
        change size: `compute_gradients`) every stage of the replica builds anew at that step, and the new
        stages infer their shapes together again (the same module, parameters and groups)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        trainer = self.trainer
        self.pp_stage = PipelineStage(trainer.model, self.stage, self.stages, trainer.device, group=self.pipe_group)
        schedule = {"gpipe": _preposted_gpipe(ScheduleGPipe), "1f1b": Schedule1F1B}[self.config.pipeline_schedule]
        self.schedule = schedule(self.pp_stage, self.parts, loss_fn=self._loss, scale_grads=True)
        self._time_stage_calls()

    def _loss(self, output: Any, which: torch.Tensor) -> torch.Tensor:
        """The task's criterion on the last stage. The schedule hands the loss function one "target"
        tensor per micro-batch (and checks it is a tensor); distrain's is the micro-batch's index, so
        the criterion sees the micro-batch itself, whatever its structure."""
        return self.trainer.task.criterion(output, self._mbs[int(which[0])])

    def _time_stage_calls(self) -> None:
        """Wrap this stage's forward and backward of one micro-batch: compute time, spans, p2p bytes."""
        stage, timer = self.pp_stage, self.timer
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        nbytes = _nbytes

        def timed_forward(mb: int, args: Any, kwargs: Any, *rest: Any, **more: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = forward(mb, args, kwargs, *rest, **more)
            t1 = time.perf_counter()
            timer.cpu += time.thread_time() - c0
            timer.compute += t1 - t0
            timer.spans.append(("F", mb, t0 - timer.origin, t1 - timer.origin))
            if not self.last:  # the output goes to the next stage; its gradient comes back
                n = nbytes(out)
                self.bytes_p2p = (self.bytes_p2p[0] + n, self.bytes_p2p[1] + n)
            return out

        def timed_backward(mb: int, *rest: Any, **more: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = backward(mb, *rest, **more)
            t1 = time.perf_counter()
            timer.cpu += time.thread_time() - c0
            timer.compute += t1 - t0
            timer.spans.append(("B", mb, t0 - timer.origin, t1 - timer.origin))
            return out

        stage.forward_one_chunk = timed_forward
        stage.backward_one_chunk = timed_backward

    def _count_input_bytes(self) -> None:
        """The activations coming in (and their gradient going back): the input's size. A hook on the
        module, registered once whatever stages are built over it."""
        if self.first:
            return

        def count_input(module: Any, args: Any) -> None:
            if _ACTIVE_TIMER is not None:
                n = _nbytes(args)
                self.bytes_p2p = (self.bytes_p2p[0] + n, self.bytes_p2p[1] + n)

        self.trainer.model.register_forward_pre_hook(count_input)

    # ------------------------------------------------------------------ the step
    # The trainer's gradient, around the schedule's step (a sharded stage's, ShardedPipelineBSP, is FSDP's).
    def _zero_grads(self, trainer: LocalTrainer) -> None:
        trainer.grads_flat.zero_()

    def _grads_done(self, trainer: LocalTrainer) -> None:
        trainer._ensure_grads_in_flat_buffer()

    def _grad_bytes(self, trainer: LocalTrainer) -> int:
        return trainer.grads_flat.numel() * trainer.grads_flat.element_size()

    def compute_gradients(self, trainer: LocalTrainer, batch: Any) -> float:
        global _ACTIVE_TIMER
        import torch
        import torch.distributed as dist

        from distrain.trainers.task import to_device

        trainer.model.train()
        self._zero_grads(trainer)
        batch = to_device(batch, trainer.device)
        samples = batch_length(batch)
        if self.built_for is not None and samples != self.built_for:  # its share moved: new micro-batch shapes
            self._build_schedule()
        self.built_for = samples
        mbs = split_batch(batch, self.parts)
        kwargs: dict[str, Any] = {}
        if self.first:
            inputs = [model_inputs(trainer.task, mb) for mb in mbs]
            kwargs["arg_mbs"] = [a for a, _ in inputs]
            kwargs["kwarg_mbs"] = [k for _, k in inputs]
        losses: list[torch.Tensor] = []
        if self.last:
            self._mbs = mbs
            kwargs["target_mbs"] = [torch.tensor([i]) for i in range(len(mbs))]
            kwargs["losses"] = losses
        self.timer.reset()
        self.bytes_p2p = (0, 0)
        _ACTIVE_TIMER = self.timer
        self.meter.live = self.meter.peak = 0
        on_gpu = self.ctx.device.startswith("cuda")
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack):
                self.schedule.step(**kwargs, return_outputs=False)
        finally:
            _ACTIVE_TIMER = None
        self._grads_done(trainer)
        # The loss is known on the last stage; every stage's row carries it (one scalar over the pipeline).
        loss = torch.stack([t.detach() for t in losses]).mean().reshape(1) if self.last else torch.zeros(1)
        loss = loss.to(torch.float64)
        if self.stages > 1:
            dist.broadcast(loss, src=self.pipeline_ranks()[-1], group=self.pipe_group)
        # The step ends for every stage at this broadcast (stage 0's last backward ends it), so each
        # stage's step time covers the same span: the last stage's wait for stage 0 to finish counts as
        # its idle time, as the bubble formula counts it.
        step_s = time.perf_counter() - self.timer.origin
        delay = run_delay_s()
        trainer.last_loss = float(loss)
        self.stats = {
            "stage": self.stage,
            "replica": self.replica,
            "replica_samples": samples,
            "pipe_step_s": step_s,
            "pipe_compute_s": self.timer.compute,
            "pipe_compute_cpu_s": self.timer.cpu,
            "pipe_runq_s": None if (delay is None or self.timer.run_delay is None) else delay - self.timer.run_delay,
            "pipe_wait_s": self.timer.wait,
            "pipe_idle_frac": max(0.0, 1.0 - self.timer.compute / step_s) if step_s > 0 else None,
            "mem_param_bytes": trainer.nbytes,
            "mem_grad_bytes": self._grad_bytes(trainer),
            "mem_activation_peak_bytes": self.meter.peak,
            "mem_gpu_peak_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
        }
        self.last_spans = list(self.timer.spans)
        if self.steps_run in TIMELINE_STEPS:
            import json

            wall = time.time() - (time.perf_counter() - self.timer.origin)  # the step's start, wall clock
            self.stats["pipe_spans"] = json.dumps([[k, mb, wall + a, wall + b] for k, mb, a, b in self.last_spans])
        self.steps_run += 1
        return trainer.last_loss

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        from distrain.strategies.channel import Traffic

        traffic = Traffic()
        if self.dp_group is not None:  # the stage's gradient, averaged with its R copies
            if self.share_weight != 1.0:  # its replica's share of the step (`weigh_share`)
                trainer.grads_flat.mul_(self.share_weight)
            traffic = self.channel.all_reduce("grads", trainer.grads_flat, subgroup=self.dp_group)
        if self.config.clip_grad_norm > 0:
            self._clip_replica_gradient(trainer.grads_flat)
        # Decided on the all-reduced gradient, which every copy of the stage holds: they skip together.
        # (Other stages decide on their own gradients: a non-finite loss makes every stage's non-finite.)
        applied = self.finite(all_finite(trainer.grads_flat), "all-reduced gradient")
        if applied:
            trainer.apply_update(lr)
        extra = dict(self.stats)
        from distrain.trainers.optim_state import state_bytes

        extra["mem_optim_bytes"] = state_bytes(trainer.optimizer)
        sent, got = self.bytes_p2p
        return CommStats(bytes_sent=sent, bytes_received=got, nonfinite=None if applied else True, extra=extra).add(
            traffic
        )

    def _clip_replica_gradient(self, grads: torch.Tensor) -> None:
        """--clip-grad-norm over the whole model: the S stages' squared norms summed over the pipeline group,
        then torch's clip_grad_norm_ rule (scale by limit / (norm + 1e-6) where that is below 1). Every stage
        calls it, finite or not, so the collective always matches."""
        import torch
        import torch.distributed as dist

        squares = grads.double().pow(2).sum().reshape(1)
        if self.stages > 1:
            dist.all_reduce(squares, group=self.pipe_group)
        coef = self.config.clip_grad_norm / (float(squares.sqrt()) + 1e-6)
        if coef < 1.0:
            grads.mul_(torch.tensor(coef, dtype=grads.dtype))

    # ------------------------------------------------------------------ evaluation
    def eval_share(self, shard: int, num_shards: int) -> tuple[int, int]:
        """A replica's S stages score the same share of the test set (one per replica)."""
        return self.replica, self.replicas

    def evaluate(self, trainer: LocalTrainer, batches: Iterable[Any]) -> dict[str, tuple[float, float]]:
        """A forward pass stage to stage; the last stage scores it (the others return nothing)."""
        import torch

        from distrain.trainers.task import to_device

        trainer.model.eval()
        ranks = self.pipeline_ranks()
        totals: dict[str, tuple[float, float]] = {}
        with torch.no_grad():
            for batch in batches:
                batch = to_device(batch, trainer.device)
                if self.first:
                    args, kwargs = model_inputs(trainer.task, batch)
                    out = trainer.model(*args, **kwargs)
                else:
                    out = trainer.model(_recv_tensor(ranks[self.stage - 1], self.pipe_group, trainer.device))
                if not self.last:
                    _send_tensor(out, ranks[self.stage + 1], self.pipe_group)
                    continue
                for name, (s, c) in trainer.task.evaluate_batch(_Fixed(out), batch).items():
                    before = totals.get(name, (0.0, 0.0))
                    totals[name] = (before[0] + s, before[1] + c)
        return totals

    # ------------------------------------------------------------------ state
    def at_epoch_end(self, trainer: LocalTrainer) -> CommStats | None:
        """Gather every stage's slice to the replica's stage 0, as one full state dict: checkpoints hold
        the whole model (restorable to any S, or without a pipeline) and stage 0 (rank 0) is asked."""
        import torch.distributed as dist

        from distrain.trainers.optim_state import FlatOptimizerState

        t0 = time.perf_counter()
        mine = trainer.state_dict()
        parts: list[Any] | None = [None] * self.stages if self.first else None
        dist.gather_object(mine, parts, dst=self.pipeline_ranks()[0], group=self.pipe_group)
        if self.first:
            assert parts is not None
            model: dict[str, Any] = {}
            for part in parts:
                model.update(part["model"])
            optimizer = FlatOptimizerState.concat([FlatOptimizerState.from_dict(p["optimizer"]) for p in parts])
            self.full_state = {"model": model, "optimizer": optimizer.to_dict()}
        return CommStats(seconds=time.perf_counter() - t0)

    def export_state(self, trainer: LocalTrainer) -> dict[str, Any]:
        if self.full_state is None:
            raise RuntimeError("a pipeline's state is gathered at period ends; none has been reached yet")
        return self.full_state

    def spans(self) -> list[tuple[str, int, float, float]]:
        return list(getattr(self, "last_spans", []))


def _send_tensor(t: torch.Tensor, dst: int, group: Any) -> None:
    """A tensor of any shape: a fixed header (dtype, rank, dims), then the values."""
    import torch
    import torch.distributed as dist

    t = t.contiguous()
    header = torch.zeros(10, dtype=torch.int64)
    header[0] = _DTYPES.index(t.dtype)
    header[1] = t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header, dst=dst, group=group)
    dist.send(t, dst=dst, group=group)


def _recv_tensor(src: int, group: Any, device: Any) -> torch.Tensor:
    import torch
    import torch.distributed as dist

    header = torch.zeros(10, dtype=torch.int64)
    dist.recv(header, src=src, group=group)
    shape = [int(d) for d in header[2 : 2 + int(header[1])]]
    t = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    dist.recv(t, src=src, group=group)
    return t


def _dtypes() -> list[Any]:
    import torch

    return [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


class _LazyDtypes:
    def index(self, dtype: Any) -> int:
        return _dtypes().index(dtype)

    def __getitem__(self, i: int) -> Any:
        return _dtypes()[i]


_DTYPES = _LazyDtypes()
