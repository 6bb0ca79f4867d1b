"""BSP throughput: distrain vs torchrun DDP vs Ray Train vs one process, interleaved in one invocation.

    .venv/bin/python benchmarks/bsp_throughput.py [--rounds 3] [--steps 300] [--global-batch 64]
        [--model cnn] [--dataset digits] [--workers 2] [--out benchmarks/RESULTS.md]

Every contender trains the same model (same seed, so the same initial weights) on the same samples in
the same order (distrain's `EpochSharder`, epochs wrapping around) with the same global batch, the same
number of steps and plain SGD (lr 0.05, momentum 0.9, no lr scaling):

  single         one process, batch = global batch, `--single-threads` torch threads (default 2: the
                 cores the two-worker contenders use together); `benchmarks/_ddp_worker.py`, no wrapper
  torchrun       `torchrun --standalone --nproc_per_node W` running `_ddp_worker.py`: DDP over gloo,
                 1 torch thread per process, batch = global / W per process
  raytrain       Ray Train `TorchTrainer`, ScalingConfig(num_workers=W, use_gpu=False), the same loop
                 with `ray.train.torch.prepare_model` (DDP over gloo), 1 thread per worker
  distrain       `distrain.orchestrator.run.run_training(RunConfig(strategy="bsp", workers=W, ...))`
                 in-process, cpus_per_worker=1 (so 1 thread per worker); step rows from metrics.parquet
  torchrun-flat  (diagnostic, opt-in with --contenders) distrain's own step - `LocalTrainer` + one flat
                 all-reduce after backward - under torchrun, without Ray

Measured per contender and round:
  samples/s   steady state: global batch x steps after the first --warmup-frac of steps, divided by the
              wall time from the end of the last warm-up step to the end of the last step (a step ends
              when its slowest rank ends it; every rank stamps `time.time()` after its optimizer step).
              distrain runs with --eval-every 0 (one evaluation, after the last step), so it does
              the same work as the other loops, which do not evaluate; any evaluation inside the
              window would be subtracted (as its summary.json does) and is reported.
  TTFS        time to first step: from the moment the harness launches the contender (subprocess, the
              TorchTrainer call, the run_training call) to the end of global step 0. The Ray-based
              contenders run on a Ray that is already up; the ray.init time is reported separately.

Fairness:
  * rounds interleave the contenders; the order is reversed every other round;
  * none of the harness's Ray processes exist while `single` and `torchrun` run: each round brings a local Ray up
    (`ray.init(address="local", num_cpus=4, include_dashboard=False)`), runs the Ray-based contenders
    on it, one after the other, and shuts it down before the others run. After ray.init the harness
    waits --settle seconds so the idle workers Ray prestarts finish importing before anything is timed;
    between contenders it waits --cooldown seconds;
  * nothing is tuned per contender: library defaults everywhere (DDP buckets, Ray Train and distrain
    configs), the same thread budget (2 cores' worth) for all.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
WORKER = BENCH_DIR / "_ddp_worker.py"
ALL_CONTENDERS = ("single", "torchrun", "torchrun-flat", "raytrain", "distrain")
DEFAULT_CONTENDERS = ("single", "torchrun", "raytrain", "distrain")
RAY_CONTENDERS = frozenset({"raytrain", "distrain"})
BASELINE = "torchrun"
LABELS = {
    "single": "single process",
    "torchrun": "torchrun DDP (gloo)",
    "torchrun-flat": "torchrun + distrain step (diagnostic)",
    "raytrain": "Ray Train TorchTrainer",
    "distrain": "distrain BSP",
}


@dataclass
class Measurement:
    contender: str
    round: int
    samples_per_s: float | None = None
    ttfs_s: float | None = None
    final_loss: float | None = None
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # median per-step phases, slowest rank
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# ---------------------------------------------------------------------------------------- statistics
def warmup_steps(n: int, frac: float) -> int:
    """Steps left out of the steady state: the same rule as distrain's summary (at least 1)."""
    return min(max(1, int(n * frac)), n - 1)


def steady_state(step_end: list[float], samples_per_step: int, frac: float, paused: float = 0.0) -> float:
    """Samples/s over the steps after the warm-up; `step_end[k]` is when global step k ended."""
    n = len(step_end)
    skip = warmup_steps(n, frac)
    elapsed = step_end[-1] - step_end[skip - 1] - paused
    return (n - skip) * samples_per_step / elapsed


def merge_ranks(results: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per global step: when the slowest rank ended it, and the global-batch mean loss."""
    n = min(len(r["step_end"]) for r in results)
    ends = [max(r["step_end"][k] for r in results) for k in range(n)]
    losses = [statistics.fmean(r["loss"][k] for r in results) for k in range(n)]
    return ends, losses


def median_step_ms(step_end: list[float], frac: float) -> float:
    """Median time between consecutive step ends after the warm-up, ms (robust to rare pauses)."""
    skip = warmup_steps(len(step_end), frac)
    return 1e3 * statistics.median(b - a for a, b in zip(step_end[skip - 1 : -1], step_end[skip:], strict=True))


def tail_mean(values: list[float], frac: float = 0.1) -> float:
    k = max(1, int(len(values) * frac))
    return statistics.fmean(values[-k:])


def breakdown(results: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    """Median per-step milliseconds of each phase, the largest over ranks."""
    out = {}
    for key in keys:
        if all(key in r for r in results):
            out[key] = 1e3 * max(statistics.median(r[key]) for r in results)
    return out


# ---------------------------------------------------------------------------------------- contenders
class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.a = args
        self.tmp = tmp

    def loop_args(self) -> dict[str, Any]:
        a = self.a
        return dict(
            model=a.model,
            dataset=a.dataset,
            global_batch=a.global_batch,
            steps=a.steps,
            seed=a.seed,
            lr=a.lr,
            momentum=a.momentum,
        )

    def from_rank_files(self, m: Measurement, prefix: Path, world: int, t_launch: float) -> Measurement:
        results = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world)]
        ends, losses = merge_ranks(results)
        m.samples_per_s = steady_state(ends, self.a.global_batch, self.a.warmup_frac)
        m.ttfs_s = ends[0] - t_launch
        m.final_loss = tail_mean(losses)
        m.extra["step_ms_median"] = median_step_ms(ends, self.a.warmup_frac)
        m.breakdown_ms = breakdown(results, ("data_s", "fwd_bwd_s", "comm_s", "opt_s"))
        m.extra["threads"] = sorted({r["threads"] for r in results})
        return m

    # ------------------------------------------------------------ subprocess contenders
    def run_subprocess(self, name: str, rnd: int) -> Measurement:
        a = self.a
        prefix = self.tmp / f"{name}-r{rnd}"
        common = [
            "--out",
            str(prefix),
            "--model",
            a.model,
            "--dataset",
            a.dataset,
            "--global-batch",
            str(a.global_batch),
            "--steps",
            str(a.steps),
            "--seed",
            str(a.seed),
            "--lr",
            str(a.lr),
            "--momentum",
            str(a.momentum),
        ]
        if name == "single":
            cmd = [sys.executable, str(WORKER), *common, "--threads", str(a.single_threads)]
            world = 1
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(a.workers),
                str(WORKER),
                *common,
                "--threads",
                "1",
                "--mode",
                "flat" if name == "torchrun-flat" else "ddp",
            ]
            world = a.workers
        log = self.tmp / f"{name}-r{rnd}.log"
        m = Measurement(name, rnd)
        with open(log, "w") as f:
            t_launch = time.time()
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout, cwd=BENCH_DIR.parent)
        if proc.returncode != 0:
            m.error = f"exit {proc.returncode}: {shlex.join(cmd)}\n" + log.read_text()[-3000:]
            return m
        return self.from_rank_files(m, prefix, world, t_launch)

    # ------------------------------------------------------------ Ray Train
    def run_raytrain(self, rnd: int) -> Measurement:
        import ray.train
        from ray.train.torch import TorchTrainer

        prefix = self.tmp / f"raytrain-r{rnd}"
        config = self.loop_args() | {"out": str(prefix), "bench_dir": str(BENCH_DIR)}
        m = Measurement("raytrain", rnd)
        t_launch = time.time()
        trainer = TorchTrainer(
            _ray_train_loop,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(num_workers=self.a.workers, use_gpu=False),
            run_config=ray.train.RunConfig(name=f"raytrain-r{rnd}", storage_path=str(self.tmp / "ray_results")),
        )
        trainer.fit()
        return self.from_rank_files(m, prefix, self.a.workers, t_launch)

    # ------------------------------------------------------------ distrain
    def run_distrain(self, rnd: int) -> Measurement:
        import pandas as pd

        from distrain.orchestrator.run import run_training
        from distrain.trainers.datasets import load_dataset

        a = self.a
        train_size = load_dataset(a.dataset).train_size
        steps_per_epoch = train_size // a.global_batch
        run_dir = self.tmp / f"distrain-r{rnd}"
        config = distrain_config(
            a.workers, a.model, a.dataset, a.global_batch, a.steps, run_dir, lr=a.lr, momentum=a.momentum, seed=a.seed
        )
        m = Measurement("distrain", rnd)
        t_launch = time.time()
        result = run_training(config)
        df = pd.read_parquet(run_dir / "metrics.parquet")
        steps = df[df["kind"] == "step"]
        evals = df[df["kind"] == "eval"]
        per_step = (
            steps.groupby("step")
            .agg(samples=("samples", "sum"), end=("wall_time", "max"), loss=("loss", "mean"))
            .sort_index()
        )
        ends = per_step["end"].tolist()
        samples = int(per_step["samples"].iloc[0])
        skip = warmup_steps(len(ends), a.warmup_frac)
        t_start, t_end = ends[skip - 1], ends[-1]
        inside = evals[(evals["wall_time"] > t_start) & (evals["wall_time"] <= t_end)]
        paused = float(inside["eval_s"].sum())
        m.samples_per_s = steady_state(ends, samples, a.warmup_frac, paused)
        m.extra["samples_per_s_with_pauses"] = steady_state(ends, samples, a.warmup_frac)
        m.extra["summary_samples_per_s"] = result.summary.get("steady_state_samples_per_s")
        m.extra["evals_in_window"] = len(inside)
        m.extra["eval_s_in_window"] = paused
        # Time between consecutive step ends within an epoch vs across an epoch boundary, where the
        # driver collects the segment, evaluates and starts the next one.
        gaps = per_step["end"].diff().iloc[skip:]
        boundary = set(range(steps_per_epoch, a.steps, steps_per_epoch))
        within = [g for s, g in gaps.items() if s not in boundary]
        across = [g for s, g in gaps.items() if s in boundary]
        if within:
            m.extra["step_gap_ms_within_epoch"] = 1e3 * statistics.median(within)
        if across:
            m.extra["step_gap_ms_across_epoch"] = 1e3 * statistics.median(across)
        m.final_loss = tail_mean(per_step["loss"].tolist())
        m.extra["step_ms_median"] = median_step_ms(ends, a.warmup_frac)
        window = steps[steps["step"] >= per_step.index[skip]]
        by_worker = window.groupby("worker")
        m.breakdown_ms = {
            "compute_s": 1e3 * float(by_worker["compute_s"].median().max()),
            "comm_s": 1e3 * float(by_worker["comm_s"].median().max()),
        }
        # Step rows carry wall_time relative to the run's start, which summary.json records.
        m.ttfs_s = result.summary["started_at"] + ends[0] - t_launch
        return m


def distrain_config(
    workers: int, model: str, dataset: str, global_batch: int, steps: int, run_dir: Path, *, lr: float,
    momentum: float, seed: int, **extra: Any,
):  # fmt: skip
    """The distrain contender's run: all-reduce BSP at the global batch, plain momentum SGD, no evaluation
    before the last step (as the other contenders' loops, which never evaluate). bsp_step_profile.py
    profiles this same run."""
    from distrain.config import RunConfig
    from distrain.trainers.datasets import load_dataset

    steps_per_epoch = load_dataset(dataset).train_size // global_batch
    return RunConfig(
        strategy="bsp",
        workers=workers,
        cpus_per_worker=1.0,
        model=model,
        dataset=dataset,
        batch_size=global_batch // workers,
        lr=lr,
        lr_scaling="none",
        optimizer="sgd",
        momentum=momentum,
        epochs=math.ceil(steps / steps_per_epoch),
        max_steps=steps,
        seed=seed,
        run_dir=str(run_dir),
        transport="collective",  # all-reduce BSP, the transport compared here
        eval_every=0,
        **extra,
    )


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function (pickled by value: it imports the loop by path on the worker)."""
    import sys

    if config["bench_dir"] not in sys.path:
        sys.path.insert(0, config["bench_dir"])
    import _ddp_worker
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    kwargs = {k: v for k, v in config.items() if k not in ("out", "bench_dir")}
    result = _ddp_worker.train_loop(
        **kwargs,
        threads=1,
        rank=ctx.get_world_rank(),
        world=ctx.get_world_size(),
        wrap=ray.train.torch.prepare_model,
    )
    _ddp_worker.write_result(config["out"], result)


# ---------------------------------------------------------------------------------------- Ray lifecycle
class RaySession:
    def __init__(self, settle: float) -> None:
        self.settle = settle
        self.init_s: list[float] = []
        self.up = False

    def start(self) -> None:
        import ray

        t0 = time.perf_counter()
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        self.init_s.append(time.perf_counter() - t0)
        self.up = True
        time.sleep(self.settle)

    def stop(self) -> None:
        import ray

        if self.up:
            ray.shutdown()
            self.up = False


# ---------------------------------------------------------------------------------------- reporting
def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def summarize(measurements: list[Measurement], contenders: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in contenders:
        ok = [m for m in measurements if m.contender == name and m.error is None]
        sps = [m.samples_per_s for m in ok if m.samples_per_s is not None]
        ttfs = [m.ttfs_s for m in ok if m.ttfs_s is not None]
        row: dict[str, Any] = {
            "contender": name,
            "runs": len(ok),
            "failed": sum(1 for m in measurements if m.contender == name and m.error is not None),
            "sps": statistics.median(sps) if sps else None,
            "sps_min": min(sps) if sps else None,
            "sps_max": max(sps) if sps else None,
            "ttfs": statistics.median(ttfs) if ttfs else None,
            "loss": statistics.median([m.final_loss for m in ok]) if ok else None,
        }
        keys = sorted({k for m in ok for k in m.breakdown_ms})
        row["breakdown_ms"] = {
            k: statistics.median([m.breakdown_ms[k] for m in ok if k in m.breakdown_ms]) for k in keys
        }
        extra_keys = sorted({k for m in ok for k, v in m.extra.items() if isinstance(v, int | float)})
        row["extra"] = {
            k: statistics.median([m.extra[k] for m in ok if isinstance(m.extra.get(k), int | float)])
            for k in extra_keys
        }
        rows.append(row)
    base = next((r["sps"] for r in rows if r["contender"] == BASELINE), None)
    for r in rows:
        r["ratio"] = r["sps"] / base if r["sps"] is not None and base else None
    return rows


def render(rows: list[dict[str, Any]], ray_init_s: list[float], args: argparse.Namespace) -> str:
    lines = [
        f"| contender | samples/s (median of {args.rounds}) | min–max | vs torchrun DDP | "
        "time to first step (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = LABELS[r["contender"]] + (f" ({r['failed']} failed)" if r["failed"] else "")
        ttfs = fmt(r["ttfs"], ".2f") + " s"
        if r["contender"] in RAY_CONTENDERS and r["ttfs"] is not None and ray_init_s:
            ttfs += f" (+{statistics.median(ray_init_s):.2f} s ray.init)"
        lines.append(
            f"| {name} | {fmt(r['sps'], ',.0f')} | {fmt(r['sps_min'], ',.0f')}–{fmt(r['sps_max'], ',.0f')} | "
            f"{fmt(r['ratio'], '.2f')}× | {ttfs} |"
        )
    lines += [
        "",
        "Per-step detail (medians over rounds; per-step phases are the slowest rank's median, ms):",
        "",
    ]
    lines += [
        "| contender | threads/proc | step (median) | data | fwd+bwd | comm after bwd | opt | "
        "distrain compute_s (data+fwd+bwd+opt) | loss (last 10% of steps) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = r["breakdown_ms"]
        threads = {"single": args.single_threads}.get(r["contender"], 1)
        lines.append(
            f"| {LABELS[r['contender']]} | {threads} | {fmt(r['extra'].get('step_ms_median'), '.2f')} | "
            f"{fmt(b.get('data_s'), '.2f')} | "
            f"{fmt(b.get('fwd_bwd_s'), '.2f')} | {fmt(b.get('comm_s'), '.2f')} | "
            f"{fmt(b.get('opt_s'), '.2f')} | "
            f"{fmt(b.get('compute_s'), '.2f')} | {fmt(r['loss'], '.4f')} |"
        )
    d = next((r for r in rows if r["contender"] == "distrain" and r["runs"]), None)
    if d is not None:
        e = d["extra"]
        gap = e.get("step_gap_ms_within_epoch")
        within_epoch_sps = args.global_batch / gap * 1e3 if gap else None
        lines += [
            "",
            f"distrain: samples/s with its per-epoch evaluation pauses left in: "
            f"{fmt(e.get('samples_per_s_with_pauses'), ',.0f')} (its summary.json says "
            f"{fmt(e.get('summary_samples_per_s'), ',.0f')} for the run, warm-up rule 10%); "
            f"{fmt(e.get('evals_in_window'), '.0f')} evaluations in the window took "
            f"{fmt(e.get('eval_s_in_window'), '.3f')} s in all; step-to-step gap "
            f"{fmt(e.get('step_gap_ms_within_epoch'), '.2f')} ms within an epoch, "
            f"{fmt(e.get('step_gap_ms_across_epoch'), '.2f')} ms across an epoch boundary "
            "(segment round trip + evaluation); within epochs that is "
            f"{fmt(within_epoch_sps, ',.0f')}"
            " samples/s.",
        ]
    if ray_init_s:
        lines += [
            "",
            f"ray.init (local, num_cpus=4): median {statistics.median(ray_init_s):.2f} s over "
            f"{len(ray_init_s)} rounds; not included in the Ray-based contenders' time to first step.",
        ]
    return "\n".join(lines)


def machine_info() -> str:
    import ray
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        git = subprocess.run(
            ["git", "-C", str(BENCH_DIR.parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        git = "unknown"
    return (
        f"{os.cpu_count()} cores ({cpu}), CPU only, gloo; Python {platform.python_version()}, "
        f"torch {torch.__version__}, ray {ray.__version__}; distrain at {git}"
    )


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--model", choices=("mlp", "cnn", "resnet18"), default="cnn")
    p.add_argument("--dataset", choices=("digits", "synthetic"), default="digits")
    p.add_argument("--workers", type=int, default=2, help="processes/workers of the distributed contenders")
    p.add_argument("--single-threads", type=int, default=2, help="torch threads of the single process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-frac", type=float, default=0.1, help="share of steps left out of samples/s")
    p.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help=f"comma-separated, from: {', '.join(ALL_CONTENDERS)}",
    )
    p.add_argument("--settle", type=float, default=5.0, help="seconds to wait after ray.init")
    p.add_argument("--cooldown", type=float, default=2.0, help="seconds to wait between contenders")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one subprocess contender may take")
    p.add_argument("--out", default="", help="markdown file the results are appended to")
    p.add_argument("--raw", default="", help="JSON file for every round's measurements")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, run dirs)")
    a = p.parse_args(argv)
    contenders = [c.strip() for c in a.contenders.split(",") if c.strip()]
    bad = [c for c in contenders if c not in ALL_CONTENDERS]
    if bad or not contenders:
        p.error(f"unknown contender(s) {bad}; choose from {', '.join(ALL_CONTENDERS)}")
    a.contenders = contenders
    if a.global_batch % a.workers:
        p.error(f"--global-batch {a.global_batch} must split into --workers {a.workers} equal parts")
    if a.steps < 2 or a.rounds < 1:
        p.error("--steps must be >= 2 and --rounds >= 1")
    return a


def round_order(contenders: list[str], rnd: int) -> list[list[str]]:
    """Two groups (no Ray / on one Ray); both the group order and the order inside flip each round."""
    plain = [c for c in contenders if c not in RAY_CONTENDERS]
    on_ray = [c for c in contenders if c in RAY_CONTENDERS]
    groups = [plain, on_ray]
    if rnd % 2:
        groups = [list(reversed(g)) for g in reversed(groups)]
    return [g for g in groups if g]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    command = "python benchmarks/bsp_throughput.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    tmp = Path(tempfile.mkdtemp(prefix="bsp_throughput-"))
    bench = Bench(a, tmp)
    ray_session = RaySession(a.settle)
    measurements: list[Measurement] = []
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"# {command}\n# temp dir {tmp}; load average before: {load_before[0]:.2f}", flush=True)
    try:
        for rnd in range(a.rounds):
            for group in round_order(a.contenders, rnd):
                if group[0] in RAY_CONTENDERS:
                    ray_session.start()
                try:
                    for name in group:
                        time.sleep(a.cooldown)
                        print(f"[round {rnd + 1}/{a.rounds}] {name} ...", end=" ", flush=True)
                        try:
                            if name == "raytrain":
                                m = bench.run_raytrain(rnd)
                            elif name == "distrain":
                                m = bench.run_distrain(rnd)
                            else:
                                m = bench.run_subprocess(name, rnd)
                        except Exception as e:  # record and go on: one broken contender spoils no round
                            m = Measurement(name, rnd, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
                        measurements.append(m)
                        if m.error:
                            print(f"FAILED\n{m.error}", flush=True)
                        else:
                            print(
                                f"{fmt(m.samples_per_s, ',.0f')} samples/s, first step after "
                                f"{fmt(m.ttfs_s, '.2f')} s, loss {fmt(m.final_loss, '.4f')}",
                                flush=True,
                            )
                finally:
                    ray_session.stop()
    finally:
        if not a.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    rows = summarize(measurements, a.contenders)
    table = render(rows, ray_session.init_s, a)
    header = (
        f"Command: `{command}`  \n"
        f"Machine: {machine_info()}  \n"
        f"Started {started}; load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after.  \n"
        f"Model {a.model} on {a.dataset}, global batch {a.global_batch}, {a.steps} steps, {a.workers} "
        f"workers, SGD lr {a.lr} momentum {a.momentum}, warm-up excluded: first {a.warmup_frac:.0%} of steps."
    )
    text = header + "\n\n" + table + "\n"
    print("\n" + text)
    if a.out:
        out = Path(a.out)
        prefix = "\n" if out.exists() and out.read_text().strip() else ""
        with open(out, "a") as f:
            f.write(prefix + text)
    if a.raw:
        Path(a.raw).write_text(json.dumps([m.__dict__ for m in measurements], indent=1, default=str))
    return 1 if any(m.error for m in measurements) else 0


if __name__ == "__main__":
    sys.exit(main())
