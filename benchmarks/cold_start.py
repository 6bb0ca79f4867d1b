"""Issue 32's cold start, side by side: `distrain run --model mlp --epochs 1` from launch to the end of
step 0, and `distrain --help`, for this tree and (optionally) another, interleaved round by round.

    python benchmarks/cold_start.py --rounds 5 --baseline /path/to/a/checkout/of/main

Each contender runs in a fresh process (`python -m distrain.cli ...`) with PYTHONPATH set to a folder
holding a `distrain` link to its tree, so each imports its own code. Launch is the moment before the
process is spawned; the end of step 0 is summary.json's `started_at` plus step 0's latest `wall_time`
(its slowest rank), so the figure needs nothing from the tree beyond what every version writes. The
order flips every round. `--help`: wall time and the CPU time (user + system) it used, median of the
rounds; CPU time is the steadier figure on a shared machine. A tree that prints the start-up breakdown
(orchestrator/startup.py) has its median phases shown too.

Byte-compile both trees first (`python -m compileall -q TREE`) where PYTHONDONTWRITEBYTECODE is set:
otherwise every launch compiles the package's sources again, which an installed distrain never does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parents[1]
RUN = ["run", "--model", "mlp", "--epochs", "1"]


def package_dir(tree: Path, into: Path) -> Path:
    """A folder whose `distrain` is `tree`: PYTHONPATH to it imports that tree."""
    into.mkdir(parents=True, exist_ok=True)
    link = into / "distrain"
    if not link.exists():
        link.symlink_to(tree.resolve())
    return into


def launch(path: Path, args: list[str], cwd: Path) -> tuple[float, float, float, str]:
    """(launch time, wall s, CPU s of the process, stdout) of `python -m distrain.cli ARGS`."""
    env = dict(os.environ, PYTHONPATH=str(path), COLUMNS="200")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "distrain.cli", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return t0, wall, cpu, done.stdout


def cold_run(path: Path, work: Path, name: str) -> tuple[float, str | None]:
    """Seconds from launch to the end of step 0, and the start-up line the tree printed (if any)."""
    run_dir = work / name
    t0, _, _, out = launch(path, [*RUN, "--run-dir", str(run_dir)], work)
    started = json.loads((run_dir / "summary.json").read_text())["started_at"]
    rows = pd.read_parquet(run_dir / "metrics.parquet")
    steps = rows[rows["kind"] == "step"]
    first = steps[steps["step"] == steps["step"].min()]
    line = next((x for x in out.splitlines() if x.startswith("start-up ")), None)
    return started + float(first["wall_time"].max()) - t0, line


def phases(lines: list[str]) -> dict[str, float]:
    """Median seconds of each phase over the start-up lines."""
    found: dict[str, list[float]] = {}
    for line in lines:
        for label, seconds in re.findall(r"(imports|checks|Ray start|actors|first step) ([\d.]+) s", line):
            found.setdefault(label, []).append(float(seconds))
        for seconds in re.findall(r"ray.init ([\d.]+) s", line):
            found.setdefault("ray.init (own)", []).append(float(seconds))
        for seconds in re.findall(r"data ([\d.]+) s", line):
            found.setdefault("data (in actors)", []).append(float(seconds))
    return {k: statistics.median(v) for k, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout of distrain, to compare with this one")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cold_start_"))
    trees = {"this tree": HERE} | ({"baseline": args.baseline} if args.baseline else {})
    paths = {name: package_dir(tree, work / f"pkg-{i}") for i, (name, tree) in enumerate(trees.items())}
    cold: dict[str, list[float]] = {n: [] for n in trees}
    helps: dict[str, list[tuple[float, float]]] = {n: [] for n in trees}
    lines: dict[str, list[str]] = {n: [] for n in trees}
    print(f"load average before: {os.getloadavg()}")
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            seconds, line = cold_run(paths[name], work, f"r{r}-{name.replace(' ', '_')}")
            cold[name].append(seconds)
            if line:
                lines[name].append(line)
            _, wall, cpu, _ = launch(paths[name], ["--help"], work)
            helps[name].append((wall, cpu))
            took = f"step 0 ended {seconds:.2f} s after launch; --help {wall:.2f} s ({cpu:.2f} s CPU)"
            print(f"round {r + 1} {name}: {took}")
            if line:
                print(f"    {line}")
    print(f"load average after: {os.getloadavg()}")
    print("\n| tree | launch to end of step 0, median | range | `--help` wall, median | `--help` CPU, median |")
    print("|---|---:|---|---:|---:|")
    for name in trees:
        c, h = cold[name], helps[name]
        print(
            f"| {name} | {statistics.median(c):.2f} s | {min(c):.2f}-{max(c):.2f} s "
            f"| {statistics.median(w for w, _ in h):.2f} s | {statistics.median(u for _, u in h):.2f} s |"
        )
    if args.baseline:
        ratio = statistics.median(cold["this tree"]) / statistics.median(cold["baseline"])
        per_round = [a / b for a, b in zip(cold["this tree"], cold["baseline"], strict=True)]
        print(f"\nthis tree / baseline, cold start: {ratio:.2f} (per round {', '.join(f'{x:.2f}' for x in per_round)})")
        help_cpu = statistics.median(u for _, u in helps["this tree"]) / statistics.median(
            u for _, u in helps["baseline"]
        )
        print(f"this tree / baseline, --help CPU: {help_cpu:.2f}")
    for name in trees:
        if lines[name]:
            print(f"\n{name}, median phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases(lines[name]).items()))


if __name__ == "__main__":
    main()
