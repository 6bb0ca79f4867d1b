"""The help texts of `run`, `plan` and `tune` (and run's exit codes), apart from the commands' modules:
`distrain --help` lists the commands from these alone, without loading the config's fields behind the
commands' options (cli.py builds those only for a command that is run or asked for its own help)."""

from __future__ import annotations

from distrain.errors import RunFailed

DIVERGED_EXIT_CODE = 3  # not 2: files were written (the metrics, the summary); not 1: no bug either
# What `distrain run` exits with (docs/flags.md, and `distrain run --help`). 1 is left to bugs
# (a traceback, the worker's own error among them).
EXIT_CODES = {
    0: "completed",
    2: "bad input",
    DIVERGED_EXIT_CODE: "diverged",
    RunFailed.exit_code: "failed after it started (--max-failures used up, disk full)",
    130: "interrupted (SIGINT)",
    143: "interrupted (SIGTERM)",
}

RUN_HELP = f"""Train one model with one strategy; writes runs/<id>/ (config, metrics, summary, checkpoints).

Every on/off flag also has a --no- form (e.g. --no-staleness-lr) that turns off what --config turns on.

Exit codes: {", ".join(f"{code} {what}" for code, what in EXIT_CODES.items())}."""

PLAN_HELP = """Predict step time, traffic and memory of every strategy at each worker count, calibrated on this
cluster with a few real steps and micro-benchmarks; recommend one, with its reason. With --fsdp or
--tensor-parallel, or a model over --worker-memory, also BSP and DiLoCo across cut replicas (the layouts
that fit)."""

TUNE_HELP = "Sweep batch size, LR scaling, warmup, LR (and more) with Ray Tune; each trial is a distributed run."
