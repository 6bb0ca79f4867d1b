"""The planner's calibration: a few real steps and two micro-benchmarks on the cluster at hand.

- Four tiny real runs of the task (`--max-steps`, evaluation only at the end): BSP over the
  collective at N=1 (compute and per-step overhead alone); local SGD at N=2 with a τ past the run's
  end (two workers computing at once and never averaging: how much they stretch each other, i.e. the
  machine's effective cores, and what a second worker adds to the overhead); BSP at N=2 (its step over
  the previous run's is what synchronising costs here, set against the model's all-reduce and
  straggler wait: `sync_scale`); async over the PS at N=1 (the round trip of a push and a pull).
  Per-worker steady-state step (span over count after a warm-up), medians. The runs are as long as
  the runs they predict (`distrain plan --calibration-steps`, default 40), so the driver's segment turns
  are amortised over the same window; the never-averaging run leaves out of its step the time its
  window spent averaging (its end-of-epoch average carries the group's first-call set-up).
  Stragglers: the within-round spread of BSP N=2's compute (`round_spread`).
- An all-reduce probe: two actors in a gloo group time all-reduces of three sizes; a least-squares
  line t = 2 alpha + n / beta gives latency and bandwidth.
- An echo probe: an actor call carrying n bytes out and back, against the PS round trip, leaves the
  shard's own service time (apply + serve).

Measuring contention, rather than assuming N/cores, is what makes the prediction hold on a machine
shared with others: their load is in the N=2 figure (the previous planner assumed it and was 40% off).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from distrain.config import RunConfig
from distrain.config.strategy_section import traffic_defaults
from distrain.orchestrator import memory
from distrain.planning.layout_model import Layout, layout_scale_of
from distrain.planning.planner import Calibration, settings_for

WARMUP_FRACTION = 0.25  # the first quarter of a run's steps (at least 2) is start-up, not steady state


def steady_figures(run_dir: Path) -> dict[str, Any]:
    """A run's steady-state step, from its metrics.parquet: per worker, the span of its steps after the
    warm-up over their count (so a local-SGD round's all-reduce is amortised as it is in the run);
    medians over the workers. Also the median compute_s, comm_s and wait_s of those steps."""
    return steady_figures_of(pd.read_parquet(run_dir / "metrics.parquet"), str(run_dir))


def steady_figures_of(df: pd.DataFrame, where: str = "the run", without_sync: bool = False) -> dict[str, Any]:
    """`without_sync`: leave out the time the window's steps spent communicating or waiting (comm_s,
    wait_s), for a run that is there to measure workers computing side by side without synchronising
    (the never-averaging local SGD run, whose end-of-epoch average, carrying the collective group's
    first-call set-up, would otherwise land in its window)."""
    steps = df[df["kind"] == "step"].sort_values("wall_time")
    per_worker = []
    kept = []
    for _, rows in steps.groupby("worker"):
        skip = max(2, int(len(rows) * WARMUP_FRACTION))
        rows = rows.iloc[skip:]
        if len(rows) >= 2:
            span = rows["wall_time"].iloc[-1] - rows["wall_time"].iloc[0]
            if without_sync:  # the steps after the first: the span covers their time, not the first's
                sync = sum(rows[c].iloc[1:].fillna(0.0).sum() for c in ("comm_s", "wait_s") if c in rows)
                span = max(0.0, span - float(sync))
            per_worker.append(span / (len(rows) - 1))
            kept.append(rows)
    if not kept:
        raise ValueError(f"{where} has too few steps to measure a steady state")
    body = pd.concat(kept)

    def med(column: str) -> float:
        values = body[column].dropna() if column in body else pd.Series(dtype=float)
        return float(values.median()) if not values.empty else 0.0

    compute = body["compute_s"].to_numpy(dtype=float)
    return {
        "step_s": float(statistics.median(per_worker)),
        "compute_s": med("compute_s"),
        "comm_s": med("comm_s"),
        "wait_s": med("wait_s"),
        "spread": list(np.sort(compute / np.median(compute))) if len(compute) else [1.0],
    }


def round_spread(df: pd.DataFrame) -> list[float]:
    """Within-round dispersion of compute in a synchronous run: each worker's compute_s at a step over
    that step's mean across the workers (after the warm-up). A synchronous round waits for its slowest
    member relative to the others; a burst of other load that slows every worker at once costs it
    nothing, so the pooled spread over time (which holds such bursts) overstates the wait."""
    steps = df[df["kind"] == "step"]
    if steps.empty or steps["worker"].nunique() < 2:
        return []
    table = steps.pivot_table(index="step", columns="worker", values="compute_s", aggfunc="first").dropna()
    table = table.iloc[max(2, int(len(table) * WARMUP_FRACTION)) :]
    table = table[(table > 0).all(axis=1)]
    if table.empty:
        return []
    return sorted(float(x) for x in (table.div(table.mean(axis=1), axis=0)).to_numpy().ravel())


def repeated_figures(where: Path, name: str, without_sync: bool = False) -> dict[str, Any]:
    """The median of each figure over the repeats of one tiny run (`NAME-r0`, `NAME-r1`, ...; or `NAME`);
    `round_spread` pooled over the repeats."""
    dirs = sorted(where.glob(f"{name}-r*")) or [where / name]
    frames = [pd.read_parquet(d / "metrics.parquet") for d in dirs]
    each = [steady_figures_of(df, str(d), without_sync) for df, d in zip(frames, dirs, strict=True)]
    merged: dict[str, Any] = {k: float(statistics.median(f[k] for f in each)) for k in each[0] if k != "spread"}
    merged["spread"] = sorted(x for f in each for x in f["spread"])
    merged["repeats"] = [f["step_s"] for f in each]
    merged["round_spread"] = sorted(x for df in frames for x in round_spread(df))
    return merged


def _tiny(config: RunConfig, out: Path, name: str, steps: int, **changes: Any) -> Path:
    from distrain.orchestrator.run import run_training

    run_dir = out / name
    cfg = config.replace(
        max_steps=steps, eval_every=0, checkpoint_every=0, tensorboard="", run_dir=str(run_dir), **changes
    )
    run_training(cfg)
    return run_dir


def _probes(nbytes: int, reps: int) -> dict[str, float]:
    """All-reduce latency/bandwidth (two actors, gloo) and an echo of the model's gradient."""
    import ray

    from distrain.planning.probe import Probe

    a, b = Probe.remote(), Probe.remote()
    try:
        address = ray.get(a.address.remote())
        ray.get([a.join.remote(0, 2, address), b.join.remote(1, 2, address)])
        sizes = [1024, 256 * 1024, max(4 * 2**20, nbytes)]
        times = []
        for size in sizes:  # both ranks run the same all-reduces; rank 0's medians are the figures
            t0, _ = ray.get([a.all_reduce.remote(size // 4, reps), b.all_reduce.remote(size // 4, reps)])
            times.append(t0)
        # t = 2 alpha + n / beta (P = 2: two rounds, n bytes each way in all)
        slope, intercept = np.polyfit(np.array(sizes, dtype=float), np.array(times), 1)
        alpha = max(float(intercept) / 2, 1e-6)
        beta = 1.0 / slope if slope > 0 else 1e12
        echo = ray.get(a.echo_time.remote(nbytes, reps))
        ping = ray.get(a.echo_time.remote(0, reps))
        return {"alpha": alpha, "beta": beta, "echo_s": echo, "ping_s": ping, "sizes": sizes, "times": times}
    finally:
        for actor in (a, b):
            ray.kill(actor, no_restart=True)


def flops_per_sample(config: RunConfig) -> float | None:
    """Forward + backward FLOPs of one sample of the built-in model (FlopCounterMode); None for a user's
    task, whose batches the planner cannot make up."""
    if config.task:
        return None
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from distrain.trainers.datasets import DATASETS
    from distrain.trainers.models import build_model

    info = DATASETS.get(config.dataset).info
    net = build_model(config.model, info, 0)
    x = torch.randn(8, info.channels, info.height, info.width)
    with FlopCounterMode(display=False) as counter:
        net(x).sum().backward()
    return counter.get_total_flops() / 8


REPEATS = 3  # each tiny run, interleaved: the median of three survives one run hit by a burst of other load


def calibrate(
    config: RunConfig,
    out: Path,
    steps: int = 40,
    reps: int = 20,
    repeats: int = REPEATS,
    layout: Layout | None = None,
) -> Calibration:
    """Measure the task and this cluster; the tiny runs' directories stay under `out/calibration/`
    (`NAME-rI`, I the repeat). `layout`: a cut replica the plan predicts; a fifth tiny run, BSP at R = 1 of
    it, measures its collectives (`Calibration.layout_scale`)."""
    import ray

    from distrain.orchestrator import cluster
    from distrain.orchestrator.run_checks import check_runnable

    num_params = check_runnable(config)
    config = uncut(config)
    started = False
    if not ray.is_initialized() and not config.address:
        cluster.start_local_ray(max(4, (config.ps_shards or 1) + 3))
        started = True
    where = out / "calibration"
    # The tiny runs measure this machine as it is: no codec, no emulated link; the planner adds what the
    # run's --compress and --comm-delay-ms / --comm-bandwidth change from their own figures (traffic_figures)
    base = config.replace(
        schedule="", strategy="bsp", transport="collective", address="", **traffic_defaults(),
        **settings_for("bsp", "backups", 0),
    )  # fmt: skip
    try:
        t0 = time.time()
        for r in range(repeats):  # interleaved: a burst of load hits one repeat of each, not every run of one
            _tiny(base, where, f"bsp-1-r{r}", steps, workers=1)
            # Two workers that never average (τ past the run's end): contention apart from synchronisation
            never = settings_for("local-sgd", "period", 10 * steps)
            _tiny(base.replace(strategy="local-sgd", **never), where, f"local-2-r{r}", steps, workers=2)
            _tiny(base, where, f"bsp-2-r{r}", steps, workers=2)
            async_cfg = base.replace(strategy="async", transport="ps", ps_shards=1)
            _tiny(async_cfg, where, f"async-1-r{r}", steps, workers=1)
            if layout is not None:
                _tiny(cut_config(base, layout), where, f"cut-1-r{r}", steps, workers=1)
        probe = _probes(num_params * 4, reps)
    finally:
        if started:
            ray.shutdown()
    (where / "probe.json").write_text(json.dumps(probe, indent=2))
    cal = fit(config, where, num_params, probe, time.time() - t0)
    return cal if layout is None else fit_layout(cal, where, layout)


def cut_config(base: RunConfig, layout: Layout) -> RunConfig:
    """The plain tiny runs' config cut as `layout`."""
    cut = {"fsdp": layout.fsdp, "tensor_parallel": layout.tensor_parallel}
    return base.replace(**cut, reshard_after_forward=layout.reshard_after_forward)


def fit_layout(cal: Calibration, where: Path, layout: Layout) -> Calibration:
    """`cal` with the layout's tiny run (`cut-1`) read: its measured step against the model's."""
    from dataclasses import replace

    cut = repeated_figures(where, "cut-1")
    grid = {"fsdp": layout.fsdp, "tensor_parallel": layout.tensor_parallel}
    measured = dict(cal.measured, cut_1=_figures(cut) | grid)
    return replace(cal, layout_scale=layout_scale_of(cal, layout, cut["step_s"]), measured=measured)


def uncut(config: RunConfig) -> RunConfig:
    """The run as plain workers: the tiny runs measure one worker's compute on its B samples (what FSDP
    does not split; planning/layout_model.py predicts the cut from it), and strategies other than BSP and
    DiLoCo, or a model over --worker-memory, would be refused at a cut replica's layout."""
    return config.replace(fsdp=1, tensor_parallel=1, worker_memory="")


def fit(config: RunConfig, where: Path, num_params: int, probe: dict[str, Any], seconds: float = 0.0) -> Calibration:
    """The calibration from the tiny runs' directories under `where` and the probes' figures (so a
    calibration can be refitted from what a plan kept, e.g. after a change to the model)."""
    one, two, ps = (repeated_figures(where, name) for name in ("bsp-1", "bsp-2", "async-1"))
    alone = repeated_figures(where, "local-2", without_sync=True)  # contention apart from synchronising
    c = one["compute_s"]
    overhead1 = max(0.0, one["step_s"] - c - one["comm_s"])
    # Two workers at once, neither waiting for the other: how much the second stretched the whole step
    # (its compute, overhead, the driver's share, other users' load around it).
    stretch2 = alone["step_s"] / one["step_s"] if one["step_s"] else 1.0
    slope, noise = contention_slope(stretch2, one["repeats"])
    cores = float(max(1, _ray_cpus(config)))
    s2 = max(1.0, 1.0 + slope, 2 / cores)
    # Stragglers: the dispersion inside BSP N=2's rounds (what a round waits for), not over time
    spread = [float(x) for x in (two["round_spread"] or alone["spread"])]
    # BSP at N=2 over the same run without averaging: what synchronising costs here, against the model's
    ring2 = (2 * probe["alpha"] + num_params * 4 / probe["beta"]) * s2
    from distrain.planning.planner import expected_max

    modelled = ring2 + c * s2 * (expected_max(spread, 2) - 1)
    sync2 = max(0.0, two["step_s"] - alone["step_s"])
    est = memory.estimate(uncut(config).replace(workers=1), num_params)  # the plain rows' worker
    return Calibration(
        task=f"{config.model} on {config.dataset}" if not config.task else config.task,
        batch_size=config.batch_size,
        num_params=num_params,
        compute_s=c,
        effective_cores=cores,
        spread=spread,
        allreduce_latency_s=probe["alpha"],
        allreduce_bandwidth=probe["beta"],
        sync_scale=sync2 / modelled if modelled else 1.0,
        # the whole non-compute part of a PS step at N=1 beyond the collective's overhead
        ps_call_s=max(ps["comm_s"], ps["step_s"] - c - overhead1),
        ps_bandwidth=(num_params * 8 / probe["echo_s"]) if probe["echo_s"] else probe["beta"],
        ps_apply_s=max(0.0, ps["comm_s"] - probe["echo_s"]),
        **traffic_figures(config, num_params),
        train_samples=_train_samples(config),
        memory_per_worker=est.per_worker,
        memory_per_shard=memory.PROCESS_BYTES + num_params * 4 * 3,
        flops_per_sample=flops_per_sample(config),
        optimizer_copies=memory.optimizer_copies(config.optimizer, config.momentum),
        step_overhead_s=overhead1,
        contention_slope=slope,
        measured={
            "bsp_1": _figures(one),  # medians; "repeats": each run's step
            "local_2": _figures(alone),
            "bsp_2": _figures(two),
            "async_1": _figures(ps),
            "stretch_2": stretch2,
            "stretch_2_noise": noise,
            "sync_2_measured_s": sync2,
            "sync_2_modelled_s": modelled,
            "probe": probe,
            "seconds": seconds,
        },
    )


def contention_slope(stretch2: float, one_repeats: list[float]) -> tuple[float, float]:
    """(slope, noise): the measured stretch of a step at N=2 over N=1, less one, unless it is within the
    noise of the N=1 step itself (its repeats' range over their median): such a stretch cannot be told
    from none (a machine with cores to spare), and a slope of noise would be extrapolated linearly to
    every N (x7 at N=8). With one repeat there is no noise figure: the stretch as measured."""
    r = one_repeats
    noise = (max(r) - min(r)) / statistics.median(r) if len(r) > 1 and statistics.median(r) > 0 else 0.0
    return (max(0.0, stretch2 - 1.0) if stretch2 - 1.0 > noise else 0.0), noise


def traffic_figures(config: RunConfig, num_params: int) -> dict[str, Any]:
    """What the run's own flags change on the wire, for the planner: --compress (the codec's transfers,
    read from its encoding of a real tensor of the model's shapes: compressed_collective.wire_parts; a PS
    push: each shard's slice encoded, summed, as ps_client counts it), the emulated link of
    --comm-delay-ms / --comm-bandwidth (network.Link, as the run builds it), and BSP's buckets."""
    from distrain.compression.spec import codec_of
    from distrain.strategies.network import Link

    link = Link.of(config)
    figures: dict[str, Any] = {
        "link_latency_s": link.latency_s, "link_bandwidth": link.bytes_per_s, "buckets": 1, "codec": None,
        "codec_parts": [], "ps_push_bytes": None,
    }  # fmt: skip
    spec = codec_of(config)
    shapes = _param_shapes(config) if spec is not None or link.emulated else None
    if shapes is not None:
        import torch

        from distrain.strategies.collective import OverlappedAllReduce

        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        buckets = OverlappedAllReduce(params, torch.zeros(num_params), 2)  # the run's own bucketing
        figures["buckets"] = len(buckets.buckets)
        buckets.remove()
    if spec is not None:
        import torch

        from distrain.strategies.compressed_collective import wire_parts
        from distrain.strategies.partition import partition

        figures["codec"] = str(spec)
        figures["codec_parts"] = [list(p) for p in wire_parts(spec, shapes)]
        if not spec.needs_shapes:  # PowerSGD needs whole matrices: the PS refuses it
            grad = torch.randn(num_params, generator=torch.Generator().manual_seed(0))
            codec = spec.build()
            figures["ps_push_bytes"] = float(
                sum(codec.encode(grad[lo:hi].clone()).nbytes for lo, hi in partition(num_params, config.ps_shards or 1))
            )
    return figures


def _train_samples(config: RunConfig) -> int | None:
    """The built-in data set's training size (a user's task: None, its periods then counted without
    epoch ends)."""
    if config.task:
        return None
    from distrain.trainers.datasets import DATASETS
    from distrain.trainers.splits import train_part_size

    return train_part_size(int(DATASETS.get(config.dataset).train_size), config.val_fraction)


def _param_shapes(config: RunConfig) -> list[tuple[int, ...]]:
    from distrain.orchestrator.tasks import build_task

    return [tuple(p.shape) for p in build_task(config).build_model().parameters() if p.requires_grad]


def _figures(merged: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in merged.items() if k not in ("spread", "round_spread")}


def _ray_cpus(config: RunConfig) -> float:
    import os

    return float(os.cpu_count() or 2)
