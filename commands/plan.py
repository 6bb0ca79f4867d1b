"""`distrain plan`: its own options (the worker counts to compare, the machine to plan for, the
calibration) and the run options that describe the task and its training (model, data, batch,
optimizer, ...; the traffic's codec and emulated link), then the plan's tables and recommendation."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from distrain.commands import console as consoles
from distrain.commands.console import print_wide, say
from distrain.commands.help_texts import PLAN_HELP
from distrain.commands.options import own_option, parse_task_args, run_options
from distrain.compression.spec import FLAG as CODEC_FLAG
from distrain.config import RunConfig, parse_optimizer_args
from distrain.config.strategy_section import TRAFFIC_FIELDS
from distrain.errors import DistrainError
from distrain.fields import SECTIONS

# plan's own, or moot (--worker-group, --worker-weights, --balance: plan's --worker-speeds says what unequal
# workers would gain; its tiny runs are one worker each)
PLAN_FLAGS = {"config", "resume", "workers", "worker_groups", "worker_weights", "balance", "strategy", "transport",
              "schedule", "run_dir"}  # fmt: skip
PLAN_TRAFFIC_FLAGS = TRAFFIC_FIELDS  # what every strategy's traffic goes through (the channel's)

HELP = PLAN_HELP


def parameters() -> list[inspect.Parameter]:
    """`plan`'s own options, then the run options of every section but the strategy's (plus the traffic's
    codec and link), less those plan sets itself."""

    def own(name: str, kind: Any, help: str, default: Any = None) -> inspect.Parameter:
        flag = "--" + name.replace("_", "-").removesuffix("-dir")
        return own_option(
            name, kind, default, flag, help=help, show_default=default is not None, rich_help_panel="plan"
        )

    return [
        own("workers", str, "Worker counts to compare, a comma list, e.g. 1,2,4,64,1024.", "1,2,4"),
        own("out_dir", Path | None, "Directory for plan.json, predictions.parquet, plan.png; must be new or empty."),
        own("preset", str | None, "What-if hardware by name: " + ", ".join(_preset_names()) + "."),
        own("bandwidth", str | None, "What-if link rate, e.g. 25gbit (same units as --comm-bandwidth)."),
        own("latency", str | None, "What-if link latency, e.g. 5us or 0.2ms."),
        own("gpu_flops", str | None, "What-if achieved FLOP/s per worker, e.g. 300tflops (built-in models)."),
        own("calibration", Path | None, "Reuse the calibration of an earlier plan (its directory or plan.json)."),
        own("calibration_steps", int, "Steps of each tiny calibration run (as long as the runs you plan is best).", 40),
        own("calibration_repeats", int, "Repeats of each tiny run (medians); 1 is faster, less robust to load.", 3),
        own(
            "worker_speeds",
            str | None,
            "Heterogeneous workers' relative speeds, e.g. 1,1,0.5: the step time with equal shares and with "
            "the shares --worker-weights would give.",
        ),
        own_option("config", Path | None, None, "--config", help="YAML file of run config keys."),
        *run_options(sections=[s for s in SECTIONS if s != "strategy"], also=PLAN_TRAFFIC_FLAGS, without=PLAN_FLAGS),
    ]


def _preset_names() -> list[str]:
    from distrain.planning.planner import PRESETS  # pure arithmetic: no torch, no Ray

    return list(PRESETS)


def what_if_hardware(preset: str | None, bandwidth: str | None, latency: str | None, gpu_flops: str | None) -> Any:
    """The machine --preset / --bandwidth / --latency / --gpu-flops describe (flags override the preset's
    figures), or None: plan for this cluster only."""
    from distrain.planning.planner import PRESETS, Hardware
    from distrain.units import parse_duration, parse_flops, parse_rate

    if preset is None and bandwidth is None and latency is None and gpu_flops is None:
        return None
    if preset is not None and preset not in PRESETS:
        raise DistrainError(f"--preset {preset!r} is not known; choose one of: {', '.join(PRESETS)}")
    base = PRESETS[preset] if preset else None
    if base is None and bandwidth is None:
        raise DistrainError("--latency and --gpu-flops need --bandwidth (or a --preset) to describe the link")
    return Hardware(
        name=preset or f"{bandwidth}",
        bandwidth=parse_rate(bandwidth, "--bandwidth") if bandwidth else base.bandwidth,
        latency_s=parse_duration(latency, "--latency") if latency else (base.latency_s if base else 10e-6),
        flops=parse_flops(gpu_flops) if gpu_flops else (base.flops if base else None),
        source=(base.source if base else "given on the command line")
        + ("" if latency or base else "; latency 10 us assumed (pass --latency)"),
    )


def plan(
    workers: str,
    out_dir: Path | None,
    preset: str | None,
    bandwidth: str | None,
    latency: str | None,
    gpu_flops: str | None,
    calibration: Path | None,
    calibration_steps: int,
    calibration_repeats: int,
    worker_speeds: str | None,
    config: Path | None,
    task_arg: list[str] | None = None,
    optimizer_arg: list[str] | None = None,
    **flags: Any,
) -> None:
    from distrain.planning.heterogeneous import parse_worker_speeds, share_effect
    from distrain.units import parse_worker_counts

    counts = parse_worker_counts(workers)
    speeds = parse_worker_speeds(worker_speeds) if worker_speeds is not None else None
    hardware = what_if_hardware(preset, bandwidth, latency, gpu_flops)
    if calibration_steps < 6:
        raise DistrainError(
            f"--calibration-steps must be at least 6 (a warm-up and a steady state), got {calibration_steps}"
        )
    if calibration_repeats < 1:
        raise DistrainError(f"--calibration-repeats must be at least 1, got {calibration_repeats}")
    # (a YAML's shares too: the tiny runs are one worker each, and --worker-speeds plans unequal ones)
    overrides = dict(flags, workers=1, strategy="bsp", transport="", schedule="", worker_weights="", balance="none")
    overrides["task_args"] = parse_task_args(task_arg) if task_arg else None
    overrides["optimizer_args"] = parse_optimizer_args(optimizer_arg) if optimizer_arg else None
    cfg = RunConfig.resolve(str(config) if config else None, overrides)
    from distrain.planning.command import choose_out_dir, load_calibration, make_plan

    saved = load_calibration(calibration) if calibration else None
    target = choose_out_dir(out_dir)
    if saved is None:
        what = f"{calibration_repeats} x 4 tiny runs of {calibration_steps} steps, two probes"
        if cfg.sharded or cfg.worker_memory:  # the layout's own tiny run (planning/layout_figures.py)
            what += "; a fifth run of a cut layout if one is planned"
        say(f"calibrating on this cluster ({what})...")
    result = make_plan(cfg, counts, target, hardware, saved, steps=calibration_steps, repeats=calibration_repeats)
    print_plan(result)
    if speeds is not None:
        effect = share_effect(result.calibration.compute_s, result.calibration.batch_size, speeds)
        consoles.out.print(effect.text(), markup=False, highlight=False)


def print_plan(result: Any) -> None:
    cal = result.calibration
    consoles.out.print(
        f"calibration: {cal.task}, batch {cal.batch_size}, {cal.num_params:,} parameters; compute "
        f"{cal.compute_s * 1e3:.1f} ms/step alone; a second worker stretches a step "
        f"x{1 + cal.contention_slope:.2f}; all-reduce "
        f"{cal.allreduce_latency_s * 1e6:.0f} us + {cal.allreduce_bandwidth / 1e6:.0f} MB/s; PS round trip "
        f"{cal.ps_call_s * 1e3:.1f} ms"
        + (f"; {CODEC_FLAG} {cal.codec}" if cal.codec else "")
        + (
            f"; planned for the emulated link: {cal.link_latency_s * 1e3:g} ms per transfer"
            + (f" + {cal.link_bandwidth / 1e6:g} MB/s" if cal.link_bandwidth else "")
            if cal.link_emulated
            else ""
        ),
        markup=False,
        highlight=False,
    )
    machines = [("this cluster", result.here)]
    if result.hardware is not None:
        machines.append((f"{result.hardware.name} ({result.hardware.source})", result.whatif))
    for title, rows in machines:
        table = Table(title=Text(f"predicted per worker step: {title}"))
        for i, name in enumerate(("N", "layout", "strategy", "transport", "step ms", "compute", "comm", "overlap",
                                  "wait", "samples/s", "KB/worker/step", "MiB/worker", "fan-in")):  # fmt: skip
            table.add_column(name, justify="left" if 0 < i < 4 else "right")
        for p in rows:
            table.add_row(
                str(p.workers), p.layout, p.strategy + (f" {p.setting}" if p.setting else ""), p.transport,
                f"{p.step_s * 1e3:.1f}", f"{p.compute_s * 1e3:.1f}", f"{p.comm_s * 1e3:.1f}",
                f"{p.overlap_s * 1e3:.1f}", f"{p.wait_s * 1e3:.1f}", f"{p.samples_per_s:,.0f}",
                f"{p.bytes_per_worker / 1e3:,.1f}", f"{p.memory_per_worker / 2**20:,.0f}", str(p.fan_in),
            )  # fmt: skip
        print_wide(table)
    for n, costs in result.stragglers.items():
        if n > 1:
            parts = ", ".join(f"{k} x{v:.2f}" for k, v in costs.items())
            consoles.out.print(f"stragglers at N={n} (expected round time / median step): {parts}", markup=False,
                      highlight=False)  # fmt: skip
    if result.layouts:
        cuts = ", ".join(
            " ".join(f"--{k.replace('_', '-')} {v}" for k, v in layout.flags().items())
            + f" ({layout.training_state / 2**20:,.1f} MiB of training state per worker)"
            for layout in result.layouts
        )
        consoles.out.print(f"layouts: {result.layout_reason}: {cuts}", markup=False, highlight=False)
    n = max(result.recommendations)
    rec = result.recommendations[n]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in rec.settings.items())
    consoles.out.print(f"recommended at N={n}: --strategy {rec.strategy} --transport {rec.transport} {flags}".rstrip()
              + f": {rec.reason}", markup=False, highlight=False)  # fmt: skip
    consoles.out.print(
        f"plan in {result.out}/ (plan.json, predictions.parquet, plan.png)", markup=False, highlight=False
    )
