"""The planner's analytic model: step time, traffic and memory of each strategy at N workers.

Pure arithmetic on a `Calibration` (what `calibrate.py` measured on the cluster at hand) and a
`Hardware` (the measured link, or a what-if one): no Ray, no torch. The formulas are those of
/work/shared/reference/algorithms.md, "All-reduce costs" and "Memory per worker":

- ring all-reduce of n bytes over P workers: each worker sends 2(P-1)n/P bytes in 2(P-1) rounds,
  time 2(P-1)alpha + 2(P-1)n/(P beta); double binary tree: ~2 log2(P) rounds, same bandwidth term;
- parameter server with K shards: each worker pushes n and pulls n; each shard carries P n/K each way
  and serves P calls per step (its fan-in);
- pipeline bubble (S-1)/(M+S-1);
- local SGD and DiLoCo: one round per τ (H) steps and one more at each epoch end where a period is
  pending, ceil(E/τ) rounds in an epoch of E steps (`Calibration.rounds_per_step`).

What a small machine adds, and the model has to say so rather than ignore: N worker processes time-
share the cores with each other, the driver and whatever else runs there, so each one's whole step
(compute, overhead, CPU-bound loopback communication) stretches. With L processes' worth of other load
on C cores a worker gets C/(N+L) of them, so its step grows as (N+L)/(1+L) = 1 + (N-1)/(1+L): linear in
N, with a slope that is measured (a step at N=2 concurrently over N=1, see calibrate.py), not
assumed; and never below N/C, the floor of a machine with C cores to itself.

Stragglers: a synchronous round lasts as long as its slowest member, so BSP's expected step is the
expected maximum of N draws from the measured within-round spread (each worker's compute over its
round's mean in BSP N=2: a burst of other load that slows every worker at once costs a round nothing,
so the pooled spread over time would overstate the wait), by order statistics of the empirical
distribution. k-of-n with b backups waits for the N-th fastest of N+b draws; SSP(s) lets a worker
run s clocks ahead, which absorbs a straggler's lag over s+1 steps (an approximation: the wait
divides by s+1; s=0 is BSP's wait, s=inf async's none).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from distrain.config.layout_section import grid_text
from distrain.strategies.declarations import PlanningSetting
from distrain.strategies.pipeline import bubble_fraction  # noqa: F401 - the model's pipeline term, its owner's
from distrain.strategies.strategy_lookup import strategy_class

FLOAT_BYTES = 4


# ---------------------------------------------------------------------------------------------- identities
def ring_bytes_per_worker(nbytes: int, workers: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-reduce: 2(P-1)n/P."""
    return 2 * (workers - 1) * nbytes / workers if workers > 1 else 0.0


def ring_rounds(workers: int) -> int:
    return 2 * (workers - 1)


def tree_rounds(workers: int) -> int:
    """Double binary tree: ~2 log2(P) rounds (the same bandwidth term as the ring)."""
    return 2 * math.ceil(math.log2(workers)) if workers > 1 else 0


def allreduce_time(nbytes: int, workers: int, latency_s: float, bandwidth: float, algorithm: str = "ring") -> float:
    """Seconds of one all-reduce: rounds x latency + 2(P-1)n/(P beta)."""
    if workers <= 1:
        return 0.0
    rounds = ring_rounds(workers) if algorithm == "ring" else tree_rounds(workers)
    return rounds * latency_s + ring_bytes_per_worker(nbytes, workers) / bandwidth


def wire_bytes(parts: list, workers: int) -> float:
    """Bytes one worker sends in a synchronisation made of `parts` [(collective, payload bytes)]: a "ring"
    all-reduce sends 2(P-1)/P of its payload, a "gather" (P-1) x it (as strategies/compressed_collective.py
    charges them; the parts come from the codec's own encoding of a real tensor, `wire_parts`)."""
    if workers <= 1:
        return 0.0
    return sum(ring_bytes_per_worker(b, workers) if kind == "ring" else (workers - 1) * b for kind, b in parts)


def wire_time(parts: list, workers: int, latency_s: float, bandwidth: float) -> float:
    """Seconds of a synchronisation made of `parts`: each ring as `allreduce_time`; an all-gather as P-1
    rounds of one payload each."""
    if workers <= 1:
        return 0.0
    return sum(
        allreduce_time(b, workers, latency_s, bandwidth)
        if kind == "ring"
        else (workers - 1) * (latency_s + b / bandwidth)
        for kind, b in parts
    )


def ps_shard_bytes(nbytes: int, workers: int, shards: int) -> float:
    """Bytes one shard receives per step (and sends back): P n / K."""
    return workers * nbytes / shards


def naive_root_bytes(nbytes: int, workers: int) -> float:
    """All to one and broadcast back: the root moves 2(P-1)n, with fan-in P-1."""
    return 2 * (workers - 1) * nbytes


def expected_max(samples: list[float], n: int) -> float:
    """E[max of n independent draws] from the empirical distribution of `samples` (with replacement):
    sum_i x_(i) [(i/m)^n - ((i-1)/m)^n] over the sorted samples."""
    return expected_order_stat(samples, n, n)


def expected_order_stat(samples: list[float], k: int, n: int) -> float:
    """E[k-th smallest of n draws] from the empirical distribution (k = n: the maximum). k-of-n with b
    backups waits for the N-th fastest of N+b: expected_order_stat(s, N, N+b)."""
    xs = sorted(samples)
    m = len(xs)
    if m == 0:
        return 1.0

    def cdf_kth(p: float) -> float:  # P(k-th smallest of n <= x) when P(draw <= x) = p
        return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k, n + 1))

    return sum(x * (cdf_kth(i / m) - cdf_kth((i - 1) / m)) for i, x in enumerate(xs, start=1))


# ---------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Hardware:
    """A link (and optionally a device) to plan for. bandwidth in bytes/s, latency in seconds."""

    name: str
    bandwidth: float
    latency_s: float
    flops: float | None = None  # achieved FLOP/s per worker for what-if compute; None: the measured compute
    source: str = ""


# Named what-if presets. Bandwidths are the standards' line rates; latencies are typical small-message
# figures (order of magnitude, not a specification), so a user with their own measurement passes --latency.
PRESETS: dict[str, Hardware] = {
    "10gbe": Hardware("10gbe", 10e9 / 8, 50e-6, None, "IEEE 802.3ae 10 Gbit/s Ethernet; ~50 us TCP latency (typical)"),
    "25gbe": Hardware("25gbe", 25e9 / 8, 25e-6, None, "IEEE 802.3by 25 Gbit/s Ethernet; ~25 us latency (typical)"),
    "100gbe": Hardware("100gbe", 100e9 / 8, 10e-6, None, "IEEE 802.3ba 100 Gbit/s Ethernet; ~10 us (RoCE, typical)"),
    "ib-hdr": Hardware("ib-hdr", 200e9 / 8, 2e-6, None, "InfiniBand HDR 200 Gbit/s (IBTA; NVIDIA ConnectX-6); ~2 us"),
    "ib-ndr": Hardware("ib-ndr", 400e9 / 8, 2e-6, None, "InfiniBand NDR 400 Gbit/s (IBTA; NVIDIA ConnectX-7); ~2 us"),
    "nvlink4": Hardware(
        "nvlink4", 450e9, 1e-6, 989e12 * 0.4,
        "NVLink 4 on H100 SXM: 900 GB/s total, 450 GB/s each way (NVIDIA H100 datasheet); "
        "compute 40% of 989 TFLOP/s dense bf16 (an assumed utilisation)",
    ),
}  # fmt: skip


@dataclass
class Calibration:
    """What was measured on the cluster at hand (calibrate.py), or read back from plan.json."""

    task: str
    batch_size: int
    num_params: int
    compute_s: float  # one step's forward/backward/optimizer, one worker alone (median)
    effective_cores: float  # the machine's cores: N workers stretch by at least N / effective_cores
    spread: list[float]  # step compute times / their median, for stragglers
    allreduce_latency_s: float  # alpha per ring round, two workers, this machine
    allreduce_bandwidth: float  # beta, bytes/s
    sync_scale: float  # measured synchronisation cost of BSP at N=2 over the modelled one (overlap, gloo's costs)
    ps_call_s: float  # one push+pull round trip of the model's gradient over the PS at N=1 (measured)
    ps_bandwidth: float  # bytes/s of a call's payload (echo micro-benchmark)
    ps_apply_s: float  # a shard's service time per gradient (apply + serve)
    memory_per_worker: int  # bytes (memory.estimate), workers and shards alike share `shared` once
    memory_per_shard: int
    flops_per_sample: float | None = None  # forward + backward (FlopCounterMode)
    optimizer_copies: int = 1  # per-parameter state vectors local SGD averages with θ
    step_overhead_s: float = 0.0  # per step, neither compute nor communication (data, rows, segments): measured
    contention_slope: float = 0.0  # each further busy process stretches every step by this fraction (measured)
    measured: dict[str, Any] = field(default_factory=dict)  # the raw calibration figures, for the record
    # --compress: one gradient-sized buffer's transfers [(collective, payload bytes)] as the codec encodes a
    # real tensor of the model (compressed_collective.wire_parts); empty: uncompressed float32
    codec: str | None = None
    codec_parts: list = field(default_factory=list)
    ps_push_bytes: float | None = None  # --compress on the PS: a push, the shards' encoded slices summed
    # the run's emulated network (--comm-delay-ms, --comm-bandwidth; strategies/network.py): every transfer
    # takes at least latency + bytes / bandwidth, on top of (not instead of) the real one
    link_latency_s: float = 0.0
    link_bandwidth: float | None = None
    buckets: int = 1  # BSP's all-reduce buckets (transfers on the emulated link per step)
    train_samples: int | None = None  # the training set's size (epoch ends cut local SGD's and DiLoCo's periods)
    # a cut replica's collectives (FSDP, tensor parallelism) as measured over as modelled: a tiny BSP run of
    # the planned layout at R = 1 (layout_model.layout_scale_of); None: not measured (1, nothing hidden)
    layout_scale: float | None = None

    def rounds_per_step(self, period: int, workers: int) -> float:
        """Averaging rounds per step of a strategy that averages every `period` steps: local SGD and DiLoCo
        also close a period at every epoch end (strategies/local_sgd.py, diloco.py), so an epoch of E steps
        (the training set over the global batch, the last partial one dropped) holds ceil(E / period)."""
        if not self.train_samples:
            return 1.0 / period
        epoch = max(1, self.train_samples // (self.batch_size * workers))
        return math.ceil(epoch / period) / epoch

    @property
    def ps_usable(self) -> bool:
        """Whether the run's flags allow the parameter server (--compress powersgd needs whole matrices,
        which the shards' flat slices are not: the run refuses it there)."""
        return not self.codec or self.ps_push_bytes is not None

    @property
    def link_emulated(self) -> bool:
        return self.link_latency_s > 0 or self.link_bandwidth is not None

    def link_s(self, nbytes: float, transfers: int) -> float:
        """The emulated link's time for `transfers` transfers carrying `nbytes` in all (network.py:
        one latency per transfer, then the bytes at the link's rate; queued one after another)."""
        return transfers * self.link_latency_s + (nbytes / self.link_bandwidth if self.link_bandwidth else 0.0)

    @property
    def grad_bytes(self) -> int:
        return self.num_params * FLOAT_BYTES

    def stretch(self, busy: int) -> float:
        """Contention: how much longer a step takes with `busy` processes at work than with one."""
        return max(1.0, 1.0 + self.contention_slope * (busy - 1), busy / self.effective_cores)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        return cls(**d)


# ---------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Prediction:
    strategy: str
    transport: str
    workers: int
    setting: str  # the strategy's settings as flags, e.g. "--tau 8"
    compute_s: float
    comm_s: float  # communication not hidden, per step (amortised over a round for local SGD / DiLoCo)
    overlap_s: float  # communication hidden behind compute
    wait_s: float  # waiting for the slowest (stragglers) per step
    overhead_s: float  # per step, neither compute nor communication: reading data, rows, the driver's segment turns
    bytes_per_worker: float  # bytes a worker sends per step
    memory_per_worker: int
    fan_in: int  # most messages one process receives per step (ring: 1 neighbour; PS shard: P)
    batch_size: int
    # the replica's cut (layout_model.py): `workers` is then R replicas of fsdp x tensor_parallel workers each
    fsdp: int = 1
    tensor_parallel: int = 1

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.wait_s + self.overhead_s

    @property
    def samples_per_s(self) -> float:
        """The global batch (R x D x B: tensor-parallel workers share their samples) over the step."""
        return self.workers * self.fsdp * self.batch_size / self.step_s

    @property
    def layout(self) -> str:
        """'4 workers', '2 replicas x 2 shards' (config/layout_section.grid_text)."""
        cut = {"fsdp": self.fsdp, "tensor_parallel": self.tensor_parallel}
        return grid_text({"replicas": self.workers} | cut)

    def row(self) -> dict[str, Any]:
        return asdict(self) | {"step_s": self.step_s, "samples_per_s": self.samples_per_s, "layout": self.layout}


# The settings the planner plans each strategy at (a user's own are kept) are the strategy's declared
# `planning` options at the defaults `distrain run` gives them (strategies/base.py `PlanningSetting`),
# each read by its role in the model: "period", "bound" or "backups".
def _planning(strategy: str) -> dict[str, PlanningSetting]:
    """The strategy's planned options by role."""
    return {p.role: p for p in strategy_class(strategy).planning}


def default(strategy: str, role: str) -> int:
    """The `distrain run` default of the strategy's option with this role."""
    return _planning(strategy)[role].default


def settings_for(strategy: str, role: str, value: int) -> dict[str, int]:
    """The run options (name -> value) that set the strategy's option with this role to `value`."""
    return {_planning(strategy)[role].option: value}


def _value(strategy: str, settings: dict[str, Any], role: str) -> int:
    p = _planning(strategy).get(role)
    return int(settings.get(p.option, p.default)) if p else 0


def _setting_text(strategy: str, settings: dict[str, Any]) -> str:
    """The planned options as flags ("--tau 8"); one that is off by default is named only when on."""
    flags = []
    for p in strategy_class(strategy).planning:
        value = int(settings.get(p.option, p.default))
        if value or p.default:
            flags.append(f"--{p.option.replace('_', '-')} {value}")
    return " ".join(flags)


CANDIDATES = [("bsp", "collective"), ("bsp", "ps"), ("ssp", "ps"), ("async", "ps"), ("local-sgd", "collective"),
              ("diloco", "collective")]  # fmt: skip


def _compute(cal: Calibration, hw: Hardware | None, workers: int, busy: int) -> float:
    if hw is not None and hw.flops and cal.flops_per_sample:  # what-if device: one worker per device
        return cal.flops_per_sample * cal.batch_size / hw.flops
    if hw is not None:  # one worker per machine: no time-sharing
        return cal.compute_s
    return cal.compute_s * cal.stretch(busy)


def predict(
    cal: Calibration,
    strategy: str,
    transport: str,
    workers: int,
    hw: Hardware | None = None,
    settings: dict[str, Any] | None = None,
    shards: int = 1,
) -> Prediction:
    """Predicted steady-state step of one worker. `hw` None: this machine as calibrated (contention
    included); a Hardware: one worker per machine on that link (no time-sharing). `settings`: the
    strategy's options (its declared `planning` ones count), at their run defaults where not given."""
    s = settings or {}
    backups = _value(strategy, s, "backups")
    here = hw is None
    alpha = cal.allreduce_latency_s if here else hw.latency_s
    beta = cal.allreduce_bandwidth if here else hw.bandwidth
    n = cal.grad_bytes
    ps = transport == "ps"
    busy = workers + backups
    stretch = cal.stretch(busy) if here else 1.0  # CPU-bound loopback transfers stretch with compute
    compute = _compute(cal, hw, workers, busy)
    if here:
        overhead = cal.step_overhead_s * stretch
    else:  # a cluster's driver gathers rows over the network too; the per-step part measured here stays
        overhead = cal.step_overhead_s
    # Straggler wait: a synchronous step waits for the slowest of its members.
    sync_wait = compute * (expected_order_stat(cal.spread, workers, busy) - 1.0) if workers > 1 else 0.0
    scale = cal.sync_scale if here else 1.0  # what calibration found synchronising really costs here
    comm = overlap = wait = 0.0
    sent = 0.0
    fan_in = 1
    setting = _setting_text(strategy, s)
    emulated = here and cal.link_emulated  # the run's --comm-delay-ms / --comm-bandwidth, not the probed link
    codec = [(str(k), float(b)) for k, b in cal.codec_parts]  # --compress: the codec's transfers; [] none
    if ps:
        # push n and pull n through K shards: a round trip's fixed cost, n/K bytes to each shard, and the
        # shard serving all P calls (its fan-in) one after another.
        push = float(cal.ps_push_bytes) if cal.ps_push_bytes is not None else float(n)  # --compress: encoded
        if here:  # measured round trip (push + pull): a worker blocked on it uses no core, so it is not
            # stretched; the shard serves the N workers' calls one after another
            call = max(0.0, cal.ps_call_s - (n - push) / cal.ps_bandwidth)  # fewer bytes pushed, sooner back
            shard_busy = workers * cal.ps_apply_s
            if emulated:  # one transfer per push-pull: the push and the pull of θ (ps_client.py)
                call = max(call, cal.link_s(push + n, 1))
        else:  # a full-duplex link: n out and n in at once; a shard takes in P n/K per step
            call = 2 * hw.latency_s + max(push, n) / hw.bandwidth
            shard_busy = workers * (cal.ps_apply_s + push / shards / hw.bandwidth)
        sent, fan_in = push, workers
        if strategy == "async":
            comm = call
            # throughput bound by the shard: P gradients per step can be served no faster than shard_busy
            comm = max(comm, shard_busy - compute)
        elif strategy == "ssp":
            bound = _value(strategy, s, "bound")
            comm = max(call, shard_busy - compute)
            wait = sync_wait / (bound + 1)
        else:  # bsp over the PS: every worker waits for the round
            comm = call + max(0.0, shard_busy - call)
            wait = sync_wait
    else:

        def round_s(parts: list) -> float:
            """One synchronisation: the modelled transfer here (or on the what-if link), and on an emulated
            link at least its time for these bytes (one transfer per part); a single worker sends nothing."""
            t = wire_time(parts, workers, alpha, beta) * (stretch * scale if here else 1.0)
            if emulated and workers > 1:
                t = max(t, cal.link_s(wire_bytes(parts, workers), len(parts)))
            return t

        if strategy == "local-sgd":
            period = _value(strategy, s, "period")
            copies = n * cal.optimizer_copies  # θ and the optimizer state travel together (θ's change coded)
            parts = codec + ([("ring", copies)] if copies else []) if codec else [("ring", n + copies)]
            rounds = cal.rounds_per_step(period, workers)
            comm = round_s(parts) * rounds
            wait = sync_wait * scale * rounds
            sent = wire_bytes(parts, workers) * rounds
        elif strategy == "diloco":
            period = _value(strategy, s, "period")
            parts = codec or [("ring", n)]  # the pseudo-gradient
            rounds = cal.rounds_per_step(period, workers)
            comm = round_s(parts) * rounds
            wait = sync_wait * scale * rounds
            sent = wire_bytes(parts, workers) * rounds
        elif codec:  # bsp, compressed: the codec's all-reduce runs after backward, nothing hidden
            comm = round_s(codec)
            wait = sync_wait * scale
            sent = wire_bytes(codec, workers)
        else:  # bsp: buckets all-reduce during backward; what is not hidden shows
            ring = allreduce_time(n, workers, alpha, beta) * stretch
            if here:
                visible = min(1.0, scale)
            else:  # backward is about 2/3 of a step's compute: the all-reduce hides behind that much
                visible = max(0.0, ring - compute * 2 / 3) / ring if ring else 1.0
            comm = ring * (scale if here else visible)
            overlap = ring * (1 - visible)
            if emulated and workers > 1:
                # the buckets queue on the emulated link as backward produces them: all but the last start
                # during backward (about 2/3 of the compute), so that much of the link's time can hide
                link = cal.link_s(ring_bytes_per_worker(n, workers), cal.buckets)
                hidden = compute * 2 / 3 * (cal.buckets - 1) / cal.buckets
                comm = max(comm, link - hidden)
            wait = sync_wait * scale
            sent = ring_bytes_per_worker(n, workers)
    memory = cal.memory_per_worker + (2 * n if strategy == "diloco" else 0)  # θ_g and outer momentum
    return Prediction(
        strategy,
        transport,
        workers,
        setting,
        compute,
        comm,
        overlap,
        wait,
        overhead,
        sent,
        memory,
        fan_in,
        cal.batch_size,
    )


def plan_table(
    cal: Calibration,
    worker_counts: list[int],
    hw: Hardware | None = None,
    candidates: list[tuple[str, str]] | None = None,
) -> list[Prediction]:
    usable = [(st, tr) for st, tr in (candidates or CANDIDATES) if tr != "ps" or cal.ps_usable]
    return [predict(cal, st, tr, n, hw) for n in worker_counts for st, tr in usable]


# ---------------------------------------------------------------------------------------------- stragglers
def straggler_costs(
    cal: Calibration, workers: int, backups: int = 1, bound: int | None = None
) -> dict[str, float]:
    """Expected round time of BSP at N (relative to a step without stragglers), and what k-of-n with b
    backups and SSP(s) bring it down to (s: SSP's run default unless given)."""
    bound = default("ssp", "bound") if bound is None else bound
    bsp = expected_max(cal.spread, workers)
    kofn = expected_order_stat(cal.spread, workers, workers + backups)
    ssp = 1.0 + (bsp - 1.0) / (bound + 1)
    return {"bsp": bsp, f"k_of_n_b{backups}": kofn, f"ssp_s{bound}": ssp}


# ---------------------------------------------------------------------------------------------- recommendation
COMM_HIDDEN = 0.15  # below this share of the step, communication and waiting are not worth trading accuracy for
STRAGGLER_SHARE = 0.2  # waiting above this share of a BSP step: bound staleness instead
SYNCHRONY = ["bsp", "ssp", "diloco", "local-sgd", "async"]  # most to least synchronous (best to worst per step)


@dataclass(frozen=True)
class Recommendation:
    strategy: str
    transport: str
    settings: dict[str, Any]
    reason: str
    prediction: Prediction


def recommend(
    cal: Calibration, workers: int, hw: Hardware | None = None, available: int | None = None
) -> Recommendation:
    """The most synchronous strategy whose communication and waiting are cheap enough: BSP while
    communication + waiting stay under COMM_HIDDEN of its step; SSP when the waiting is mostly
    stragglers; else local SGD with the τ that brings communication under COMM_HIDDEN (DiLoCo instead
    when τ would exceed 50: its outer optimizer is made for long periods). A strategy that does not fit
    `available` memory is never chosen."""

    def fits(p: Prediction) -> bool:
        return available is None or p.memory_per_worker * workers <= available

    transports = ("collective", "ps") if cal.ps_usable else ("collective",)
    bsp = min((predict(cal, "bsp", t, workers, hw) for t in transports), key=lambda p: p.step_s)
    share = (bsp.comm_s + bsp.wait_s) / bsp.step_s
    if workers == 1 or (share <= COMM_HIDDEN and fits(bsp)):
        why = (
            "one worker: nothing to synchronise"
            if workers == 1
            else (
                f"communication and waiting are {share:.0%} of a BSP step (<= {COMM_HIDDEN:.0%}): "
                "synchronous training costs little here"
            )
        )
        return Recommendation("bsp", bsp.transport, {}, f"{why}; predicted {bsp.samples_per_s:.0f} samples/s", bsp)
    if bsp.wait_s / bsp.step_s >= STRAGGLER_SHARE and cal.ps_usable:  # SSP runs over the parameter server
        bound = default("ssp", "bound")
        ssp = predict(cal, "ssp", "ps", workers, hw, settings_for("ssp", "bound", bound))
        if fits(ssp) and ssp.samples_per_s > bsp.samples_per_s:
            return Recommendation(
                "ssp", "ps", settings_for("ssp", "bound", bound),
                f"waiting for stragglers is {bsp.wait_s / bsp.step_s:.0%} of a BSP step; SSP({bound}) "
                f"absorbs it: {ssp.samples_per_s:.0f} against {bsp.samples_per_s:.0f} samples/s",
                ssp,
            )  # fmt: skip
    ring = predict(cal, "local-sgd", "collective", workers, hw, settings_for("local-sgd", "period", 1))
    period = max(2, math.ceil((ring.comm_s + ring.wait_s) / (COMM_HIDDEN * ring.compute_s)))
    local = predict(cal, "local-sgd", "collective", workers, hw, settings_for("local-sgd", "period", min(period, 50)))
    if local.samples_per_s <= bsp.samples_per_s * 1.1 and fits(bsp):  # not worth the staler replicas
        return Recommendation(
            "bsp", bsp.transport, {},
            f"communication and waiting are {share:.0%} of a BSP step, but neither SSP nor local SGD is predicted "
            f"over 10% faster; predicted {bsp.samples_per_s:.0f} samples/s",
            bsp,
        )  # fmt: skip
    if period <= 50:
        return Recommendation(
            "local-sgd", "collective", settings_for("local-sgd", "period", period),
            f"communication and waiting are {share:.0%} of a BSP step; averaging every {period} steps brings them "
            f"under {COMM_HIDDEN:.0%}: {local.samples_per_s:.0f} against {bsp.samples_per_s:.0f} samples/s",
            local,
        )  # fmt: skip
    h = min(500, max(50, period))
    dl = predict(cal, "diloco", "collective", workers, hw, settings_for("diloco", "period", h))
    return Recommendation(
        "diloco", "collective", settings_for("diloco", "period", h),
        f"communication is {share:.0%} of a BSP step; it needs over 50 local steps per round, where DiLoCo's "
        f"outer optimizer is made for: H={h}, {dl.samples_per_s:.0f} against {bsp.samples_per_s:.0f} samples/s",
        dl,
    )  # fmt: skip
