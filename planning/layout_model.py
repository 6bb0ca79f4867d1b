"""The planner's model of a cut replica (`--fsdp D`, `--tensor-parallel T`): step time, traffic and memory of
BSP and DiLoCo across R replicas of D x T workers each, and the choice between them.

Pure arithmetic on a `Calibration` and a `Layout` (what `layout_figures.py` reads off the model): no Ray,
no torch. Per worker and step:

- traffic: FSDP's all-gathers (two with --reshard-after-forward, else one) and reduce-scatter, (D-1)/D x
  the parameter bytes each (the all-gathers in the dtype the layers compute in: half under --precision
  bf16/fp16, as FSDP's MixedPrecisionPolicy gathers them; the reduce-scatter float32), and across
  replicas a ring all-reduce of the 1/D shard, 2(R-1)/R x P/D (HSDP, BSP only:
  `sharded_bsp.fsdp_bytes_per_step`, the figure the run's rows carry); plus tensor parallelism's
  all-reduces of activations (half-precision ones under bf16/fp16), 2(T-1)/T x their bytes: each
  rowwise layer's output in the forward, each colwise layer's input gradient in the backward (none where
  its input needs no gradient).
  DiLoCo's replicas run FSDP inside themselves only and all-reduce their part's pseudo-gradient across
  the R replicas once a round. Under --compress FSDP stays inside each replica under BSP too, and the
  average across the replicas (BSP's gradient part every step, after backward and never hidden;
  DiLoCo's pseudo-gradient part a round) is the codec's transfers of the part's shapes
  (`Layout.codec_parts`), as strategies/sharded_bsp.py and sharded_diloco.py send and count them;
- compute: FSDP does not split it (each rank computes its own B samples, the step's R x D x B global
  batch is D times a plain run's); tensor parallelism splits the planned layers' share of it T ways
  (their FLOPs over the model's, `Layout.split_share`);
- time: latency per ring round (a unit's all-gather or reduce-scatter takes D-1 rounds, an all-reduce
  2(P-1)) plus bytes over the bandwidth, on this machine stretched by the R x D x T busy processes and
  scaled by `Calibration.layout_scale`, what a tiny BSP run of the layout at R = 1 measured over this
  model (`layout_scale_of`; BSP's `sync_scale` does not carry over: DDP's all-reduce hides behind the
  backward, while FSDP's all-gathers in the forward, and its per-unit hooks, show on CPU gloo); on a
  what-if machine FSDP2's prefetch hides the collectives behind compute except one unit's; tensor
  parallelism's all-reduces sit on the critical path and never hide;
- stragglers: every one of the R x D x T workers takes part in each step's collectives (DiLoCo: the D x T
  of a replica each step, all of them once a round);
- memory: `orchestrator/memory.estimate` at the layout (1/D of the parameter copies of a worker's tensor-
  parallel part, plus the largest unit gathered whole); DiLoCo adds θ_g and the outer momentum of its part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from distrain.config.layout_section import grid_text
from distrain.planning.planner import (
    COMM_HIDDEN,
    FLOAT_BYTES,
    Calibration,
    Hardware,
    Prediction,
    Recommendation,
    _compute,
    _setting_text,
    _value,
    default,
    expected_order_stat,
    ring_bytes_per_worker,
    ring_rounds,
    settings_for,
    wire_bytes,
    wire_time,
)
from distrain.strategies.sharded_bsp import fsdp_bytes_per_step

# The strategies built across cut replicas (config/layout_section.CUT_REPLICA_STRATEGIES), over the collective.
LAYOUT_STRATEGIES = ("bsp", "diloco")


@dataclass(frozen=True)
class Layout:
    """One replica's cut and what the model says of it (`layout_figures.layout_of`)."""

    fsdp: int = 1
    tensor_parallel: int = 1
    reshard_after_forward: bool = True
    held_params: int = 0  # parameter values one tensor-parallel worker's part holds (the whole model at T = 1)
    units: int = 1  # the modules FSDP gathers one at a time (its collectives per step, each)
    tp_activation_values: int = 0  # values per sample tensor parallelism all-reduces per forward + backward
    tp_all_reduces: int = 0  # how many all-reduces those are per step
    split_share: float = 0.0  # the planned layers' share of a step's compute
    memory_per_worker: int = 0  # orchestrator/memory.estimate's per_worker at this layout
    training_state: int = 0  # its parameter copies and activations (what --worker-memory bounds)
    # --compress: one compressed average of the worker's part across the replicas, [(collective, payload
    # bytes)] (layout_figures.codec_parts); () uncompressed: HSDP's float32 all-reduce
    codec_parts: tuple = ()
    value_bytes: int = FLOAT_BYTES  # --precision bf16/fp16: 2, the dtype FSDP gathers and TP's activations are in

    @property
    def workers_per_replica(self) -> int:
        return self.fsdp * self.tensor_parallel

    def grid(self, replicas: int) -> str:
        """'2 replicas x 4 shards', as the run's summary names it."""
        return grid_text({"replicas": replicas, "fsdp": self.fsdp, "tensor_parallel": self.tensor_parallel})

    def flags(self) -> dict[str, int]:
        """The run options that make this layout (those above 1)."""
        return {k: v for k, v in (("fsdp", self.fsdp), ("tensor_parallel", self.tensor_parallel)) if v > 1}

    @property
    def param_bytes(self) -> int:
        return self.held_params * FLOAT_BYTES

    @property
    def gather_bytes(self) -> int:
        """The held parameters in the dtype FSDP gathers them in (its MixedPrecisionPolicy's param_dtype)."""
        return self.held_params * self.value_bytes

    def fsdp_bytes(self, replicas: int) -> int:
        """FSDP's (HSDP's, over `replicas`) bytes per worker and step, as the run counts them."""
        return fsdp_bytes_per_step(self.param_bytes, replicas, self.fsdp, self.reshard_after_forward, self.gather_bytes)


def tp_bytes_per_worker(layout: Layout, batch_size: int) -> float:
    """Tensor parallelism's activation all-reduces per worker and step: 2(T-1)/T x their bytes."""
    return ring_bytes_per_worker(layout.tp_activation_values * batch_size * layout.value_bytes, layout.tensor_parallel)


def inner_bytes_per_worker(layout: Layout, replicas: int, batch_size: int) -> float:
    """Bytes one worker sends per step inside its step's collectives: FSDP over `replicas` (HSDP: R; a
    replica alone: 1) and tensor parallelism's activations."""
    return layout.fsdp_bytes(replicas) + tp_bytes_per_worker(layout, batch_size)


def _inner_rounds(layout: Layout, replicas: int) -> int:
    """Latency rounds of a step's collectives: per FSDP unit D-1 for each all-gather and the reduce-scatter
    and 2(R-1) for the all-reduce across replicas; 2(T-1) per tensor-parallel all-reduce."""
    d, t = layout.fsdp, layout.tensor_parallel
    gathers = 2 if layout.reshard_after_forward else 1
    fsdp = layout.units * ((gathers + 1) * (d - 1) + ring_rounds(replicas)) if d * replicas > 1 else 0
    return fsdp + layout.tp_all_reduces * ring_rounds(t)


def predict_layout(
    cal: Calibration,
    strategy: str,
    replicas: int,
    layout: Layout,
    hw: Hardware | None = None,
    settings: dict[str, int] | None = None,
) -> Prediction:
    """Predicted steady-state step of one worker of R = `replicas` replicas cut as `layout` (`hw` None:
    this machine as calibrated; a Hardware: one worker per device on that link)."""
    if strategy not in LAYOUT_STRATEGIES:
        raise ValueError(f"{strategy} is not built across cut replicas ({', '.join(LAYOUT_STRATEGIES)} are)")
    here = hw is None
    alpha = cal.allreduce_latency_s if here else hw.latency_s
    beta = cal.allreduce_bandwidth if here else hw.bandwidth
    busy = replicas * layout.workers_per_replica
    stretch = cal.stretch(busy) if here else 1.0
    scale = cal.sync_scale if here else 1.0
    t = layout.tensor_parallel
    compute = _compute(cal, hw, busy, busy) * (1 - layout.split_share + layout.split_share / t)
    overhead = cal.step_overhead_s * stretch if here else cal.step_overhead_s
    diloco = strategy == "diloco"
    parts = list(layout.codec_parts)  # --compress: the part's coded average across the replicas
    # DiLoCo's replicas step alone between rounds; under a codec BSP's FSDP stays inside each replica too
    fsdp_replicas = 1 if diloco or parts else replicas
    tp_time = layout.tp_all_reduces * ring_rounds(t) * alpha + tp_bytes_per_worker(layout, cal.batch_size) / beta
    fsdp_bytes = layout.fsdp_bytes(fsdp_replicas)
    fsdp_time = (_inner_rounds(layout, fsdp_replicas) - layout.tp_all_reduces * ring_rounds(t)) * alpha
    fsdp_time += fsdp_bytes / beta
    if here:  # contention stretches them, the measured layout_scale corrects the model
        cut = 1.0 if cal.layout_scale is None else cal.layout_scale
        fsdp_comm, tp_comm = fsdp_time * stretch * cut, tp_time * stretch * cut
        overlap = fsdp_time * stretch * (1 - min(1.0, cut))
    else:  # FSDP2 prefetches the next unit's all-gather while one computes: all but one unit's can hide
        fsdp_comm = max(fsdp_time / max(1, layout.units), fsdp_time - compute)
        tp_comm, overlap = tp_time, fsdp_time - fsdp_comm
    synced = (layout.workers_per_replica if diloco else busy) if busy > 1 else 1
    straggle = compute * (expected_order_stat(cal.spread, synced, synced) - 1.0) if synced > 1 else 0.0
    comm, wait, sent = fsdp_comm + tp_comm, straggle * scale, fsdp_bytes + tp_bytes_per_worker(layout, cal.batch_size)
    emulated = here and cal.link_emulated and replicas > 1

    def across(coded: list) -> float:
        """One average across the R replicas; on the run's emulated link (--comm-delay-ms/--comm-bandwidth:
        it carries only the traffic between replicas, never FSDP's or TP's inside one) at least its time."""
        wire = wire_time(coded, replicas, alpha, beta) * (stretch * scale if here else 1.0)
        return max(wire, cal.link_s(wire_bytes(coded, replicas), len(coded))) if emulated else wire

    if parts and not diloco:  # BSP: each part's coded average over the R replicas after backward, not hidden
        comm += across(parts)
        sent += wire_bytes(parts, replicas)
    memory = layout.memory_per_worker
    setting = ""
    s = settings or {}
    if diloco:  # one round every H steps (and at epoch ends): this part's pseudo-gradient across the replicas
        period = _value("diloco", s, "period")
        rounds = cal.rounds_per_step(period, replicas * layout.fsdp)
        part = layout.param_bytes // layout.fsdp
        pseudo = parts or [("ring", part)]  # this part's pseudo-gradient, coded or float32
        comm += across(pseudo) * rounds
        if replicas > 1:
            wait += compute * (expected_order_stat(cal.spread, busy, busy) - 1.0) * scale * rounds
        sent += wire_bytes(pseudo, replicas) * rounds
        memory += 2 * part  # θ_g and the outer momentum, of this worker's part
        setting = _setting_text("diloco", s)
    return Prediction(
        strategy, "collective", replicas, setting, compute, comm, overlap, wait, overhead, sent, memory, 1,
        cal.batch_size, fsdp=layout.fsdp, tensor_parallel=t,
    )  # fmt: skip


def layout_table(
    cal: Calibration, worker_counts: list[int], layouts: list[Layout], hw: Hardware | None = None
) -> list[Prediction]:
    """BSP and DiLoCo (at its run default H) at every replica count and layout."""
    return [
        predict_layout(cal, st, n, layout, hw) for layout in layouts for n in worker_counts for st in LAYOUT_STRATEGIES
    ]


def recommend_layout(
    cal: Calibration, replicas: int, layout: Layout, why: str, hw: Hardware | None = None
) -> Recommendation:
    """BSP across R replicas cut as `layout`, unless its communication and waiting are over COMM_HIDDEN of
    its step and DiLoCo (at its run default H: only the traffic across replicas is amortised, FSDP's
    inside a replica is paid every step) is predicted over 10% faster. `why`: how the layout came (the
    model not fitting one worker, or the run's own flags), the reason's first words."""
    flags = layout.flags()
    bsp = predict_layout(cal, "bsp", replicas, layout, hw)
    share = (bsp.comm_s + bsp.wait_s) / bsp.step_s
    grid = layout.grid(replicas)
    if replicas > 1 and share > COMM_HIDDEN:
        h = default("diloco", "period")
        dl = predict_layout(cal, "diloco", replicas, layout, hw, settings_for("diloco", "period", h))
        if dl.samples_per_s > bsp.samples_per_s * 1.1:
            return Recommendation(
                "diloco", "collective", flags | settings_for("diloco", "period", h),
                f"{why}; {grid}: communication and waiting are {share:.0%} of a BSP step, DiLoCo with H={h} "
                f"syncs the replicas once a round: {dl.samples_per_s:.0f} against {bsp.samples_per_s:.0f} samples/s",
                dl,
            )  # fmt: skip
    return Recommendation(
        "bsp", "collective", flags,
        f"{why}; {grid} under BSP: communication and waiting are {share:.0%} of its step; predicted "
        f"{bsp.samples_per_s:.0f} samples/s",
        bsp,
    )  # fmt: skip


def recommend_among(
    cal: Calibration, replicas: int, layouts: list[Layout], why: str, hw: Hardware | None = None
) -> Recommendation:
    """`recommend_layout` at each of `layouts`; the one predicted to train the most samples per second."""
    recs = [recommend_layout(cal, replicas, layout, why, hw) for layout in layouts]
    return max(recs, key=lambda r: r.prediction.samples_per_s)


def layout_scale_of(cal: Calibration, layout: Layout, measured_step_s: float) -> float:
    """The factor on a cut replica's modelled collectives (on this machine) that makes BSP's predicted step
    at R = 1 the measured one: what the step spent beyond compute, waiting and overhead over the model's
    communication (at least 0; 1 where the layout communicates nothing)."""
    p = predict_layout(replace(cal, layout_scale=1.0), "bsp", 1, layout)
    if p.comm_s <= 0:
        return 1.0
    return max(0.0, (measured_step_s - (p.step_s - p.comm_s)) / p.comm_s)
